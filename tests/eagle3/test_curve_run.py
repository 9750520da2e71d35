"""experiments/eagle3/curve_run.py: the GPU-trained head of the option-D lease (docs/journal/2026-12-05-h200-d) as a
D-train MLflow run in a temporary SQLite store: every curve row a metric history point at its step, the summary's
held-out accept length as a final metric, both files as artifacts; a folder without them refused before anything is
written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.eagle3.curve_run import CURVE, SUMMARY, main

LEASE = ROOT / "docs" / "journal" / "2026-12-05-h200-d"


def test_the_leases_curve_becomes_metric_histories(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert main([str(LEASE), "--experiment", "smollm2_135m@h200", "--tracking-uri", uri]) == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("smollm2_135m@h200").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "D-train"
    rows = [json.loads(line) for line in (LEASE / CURVE).read_text().splitlines()]
    val = [(r["step"], r["value"]) for r in rows if r["name"] == "val/accept_length_est_3"]
    history = client.get_metric_history(run.info.run_id, "val/accept_length_est_3")
    assert sorted((m.step, m.value) for m in history) == sorted(val) and len(val) >= 4
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == sum(r["name"] == "train/loss"
                                                                                  for r in rows)
    summary = json.loads((LEASE / SUMMARY).read_text())
    assert run.data.metrics["final/val_accept_length_est_3"] == summary["val_accept_length_est_3"]
    assert run.data.params["train.data"] == "sharegpt" and run.data.params["train.steps"] == str(summary["steps"])
    names = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "head")}
    assert names == {CURVE, SUMMARY}
    assert any((tmp_path / "artifacts").rglob(CURVE))      # beside the store, as imported runs keep theirs


def test_a_folder_without_a_curve_is_refused_before_any_write(tmp_path: Path) -> None:
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / SUMMARY).write_text("{}")
    done = subprocess.run([sys.executable, "-m", "experiments.eagle3.curve_run", str(tmp_path / "head"),
                           "--experiment", "x", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and CURVE in done.stderr
    assert not (tmp_path / "m.db").exists()
