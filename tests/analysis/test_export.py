"""`experiments.analysis.export` over a real store: the H200 runs of 2026-11-30 imported by the workspace's importer
(tests/conftest.py `old_store`: 18 measured runs at c = 1, 4, 8, seven sweep parents). Row counts and values are
checked against the store and against the offline runs' own files in the journal's archive."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import OLD_RUNS
from mlflow.tracking import MlflowClient

from experiments.analysis.export import export
from experiments.config.paths import ROOT

H200 = "smollm2_135m@h200"


@pytest.fixture(scope="module")
def exported(old_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    return export(MlflowClient(old_store), H200, out), out, MlflowClient(old_store)


def archived_records() -> dict[str, int]:
    """Records per offline run id, counted in the journal's archive itself."""
    counts: dict[str, int] = {}
    with tarfile.open(OLD_RUNS) as tar:
        for member in tar.getmembers():
            if member.isfile() and "/artifacts/records/" in member.name and member.name.endswith(".jsonl"):
                lines = tar.extractfile(member).read().decode().splitlines()
                run_id = member.name.split("/artifacts/")[0].rsplit("/", 1)[-1]
                counts[run_id] = counts.get(run_id, 0) + sum(1 for line in lines if line.strip())
    return counts


def test_one_row_per_measured_run_and_level(exported) -> None:
    done, out, _ = exported
    levels = pd.read_parquet(out / "levels.parquet")
    assert (done.runs, done.levels, len(levels)) == (18, 54, 54)
    assert levels.groupby("run_id")["concurrency"].apply(sorted).map(tuple).unique().tolist() == [(1, 4, 8)]
    assert sorted(levels["option"].unique()) == ["A", "B", "baseline"]
    assert levels["parent_run_id"].notna().all()     # every measured run was a sweep's child


def test_a_levels_metrics_and_spec_params_are_the_stores(exported) -> None:
    _, out, client = exported
    levels = pd.read_parquet(out / "levels.parquet")
    row = levels[(levels["option"] == "B") & (levels["concurrency"] == 4)].iloc[0]
    run = client.get_run(row["run_id"])
    assert row["output_tok_s"] == run.data.metrics["output_tok_s_c4"]
    assert row["ttft_p99_ms"] == run.data.metrics["ttft_p99_ms_c4"]
    assert row["speedup_vs_baseline"] == run.data.metrics["speedup_vs_baseline_c4"]
    assert row["spec.method"] == run.data.params["spec.method"] == "eagle3"
    assert row["spec.num_steps"] == int(run.data.params["spec.num_steps"])
    assert row["baseline_run_id"] == run.data.tags["specws.baseline_run_id"]


def test_the_csv_holds_the_parquets_rows(exported) -> None:
    _, out, _ = exported
    csv, parquet = pd.read_csv(out / "levels.csv"), pd.read_parquet(out / "levels.parquet")
    assert list(csv.columns) == list(parquet.columns) and len(csv) == len(parquet)
    assert csv["output_tok_s"].tolist() == pytest.approx(parquet["output_tok_s"].tolist(), rel=1e-12)


def test_every_record_of_every_run_is_exported(exported) -> None:
    done, out, client = exported
    records = pq.read_table(out / "records.parquet").to_pandas()
    per_run = records.groupby("run_id").size()
    imported_from = {r: client.get_run(r).data.tags["specws.imported_from"] for r in per_run.index}
    assert {imported_from[r]: n for r, n in per_run.items()} == archived_records()
    assert done.records == len(records) == sum(archived_records().values())
    first = records.iloc[0]
    assert isinstance(json.loads(first["meta"]), dict) and len(first["output_token_ids"]) > 0


def test_the_command_writes_the_files_and_refuses_an_unknown_experiment(old_store, tmp_path) -> None:
    command = [sys.executable, "-m", "experiments.analysis.export", "--tracking-uri", old_store, "--out", str(tmp_path)]
    out = subprocess.run([*command, H200], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "18 runs, 54 run x level rows" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["levels.csv", "levels.parquet", "records.parquet"]
    missing = subprocess.run([*command, "nope@nowhere"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and H200 in missing.stderr and "no experiment 'nope@nowhere'" in missing.stderr
