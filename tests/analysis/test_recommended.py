"""`recommended` turns a recommendation's choice for one load back into runner overrides, read from the runs it was
decided on: on the recorded H200 lease of 2026-12-01 (an offline store, as the H200 host keeps it), where nothing
paid, so every load's choice is no speculation and the best candidate is the one measured again."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf

from experiments.analysis.recommend import build, write
from experiments.analysis.recommend.remeasure import main
from experiments.analysis.report.inputs import select_runs
from experiments.config.paths import ROOT
from experiments.tracking.import_runs import offline_folder, store_archive
from experiments.tracking.offline_store import OfflineClient
from tests.analysis.leases import H200_EXPERIMENT


@pytest.fixture(scope="module")
def lease(tmp_path_factory) -> tuple[Path, Path]:
    """(the lease's offline store, the recommendation json written from it)."""
    tmp = tmp_path_factory.mktemp("recommended")
    store = offline_folder(store_archive(ROOT / "docs" / "journal" / "2026-12-01-h200"), tmp)
    client = OfflineClient(store)
    options, runs, _, _ = select_runs(client, H200_EXPERIMENT)
    json_path, _ = write(build(client, options, runs), tmp / "out", "h200", "test")
    return store, json_path


def _overrides(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err


def test_the_best_candidate_where_nothing_pays_is_measured_again(lease, capsys) -> None:
    store, json_path = lease
    doc = json.loads(json_path.read_text())
    decision = next(d for w in doc["workloads"] if w["prompt_set"] == "grounded" for d in w["loads"]
                    if d["concurrency"] == 1)
    assert decision["choice"] == "no speculation"
    best = max(decision["candidates"], key=lambda c: c["speedup"]["low"])
    rc, out, err = _overrides(capsys, str(json_path.parent), "--concurrency", "1", "--workload", "grounded",
                              "--tracking-uri", f"offline://{store}")
    assert rc == 0, err
    assert "no speculation" in err and best["label"] in err
    run = OfflineClient(store).get_run(best["runs"][0])
    cfg = compose_cfg(*out.split(), "site=h200")
    assert f"+option={run.data.tags['specws.option']}" in out.split()
    for key in ("spec.method", "spec.num_steps", "spec.num_draft_tokens"):
        assert str(OmegaConf.select(cfg, key)) == run.data.params[key], key


def test_a_load_the_recommendation_has_not_is_refused(lease, capsys) -> None:
    store, json_path = lease
    rc, out, err = _overrides(capsys, str(json_path), "--arrival", "poisson", "--rate", "8", "--tracking-uri",
                              f"offline://{store}")
    assert rc == 2 and out == "" and "no load poisson rate=8.0" in err
    rc, out, err = _overrides(capsys, str(json_path), "--concurrency", "1", "--tracking-uri", f"offline://{store}")
    assert rc == 2 and "name one with --workload" in err, err


def test_recommend_runs_on_the_offline_store_without_mlflow(lease, tmp_path) -> None:
    """As on the H200 host, where the plan recommends between its sweeps and its confirmation run."""
    store, _ = lease
    script = ("import sys\nfor m in ('mlflow', 'mlflow.tracking', 'mlflow.exceptions'): sys.modules[m] = None\n"
              "from experiments.analysis.recommend import main\n"
              f"sys.exit(main(['--experiment', '{H200_EXPERIMENT}', '--tracking-uri', 'offline://{store}', "
              f"'--out', '{tmp_path}']))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "**no speculation at c = 1–8**" in out.stdout
    (written,) = tmp_path.glob("recommendation-*.json")
    assert {"chat", "grounded"} <= {w["prompt_set"] for w in json.loads(written.read_text())["workloads"]}
