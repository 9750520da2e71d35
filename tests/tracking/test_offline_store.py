"""Hosts without MLflow record runs as files (offline://); the importer logs them into an MLflow store (measured on a
real engine: tests/e2e/test_offline_pair.py)."""
from __future__ import annotations

from pathlib import Path

from conftest import import_into, run_workspace

from experiments.config.paths import ROOT
from experiments.tracking.offline_store import OfflineClient


def test_offline_client_search_matches_tags_and_status(tmp_path: Path) -> None:
    client = OfflineClient(tmp_path)
    a = client.create_run("exp", "a", {"specws.option": "baseline", "specws.pair_key": "k1"}).info.run_id
    b = client.create_run("exp", "b", {"specws.option": "baseline", "specws.pair_key": "k2"}).info.run_id
    client.set_terminated(a, "FINISHED")
    found = client.search_runs(["exp"], "tags.`specws.option` = 'baseline' AND tags.`specws.pair_key` = 'k1' "
                                        "AND attributes.status = 'FINISHED'")
    assert [r.info.run_id for r in found] == [a]
    assert client.search_runs(["exp"], "tags.`specws.pair_key` = 'k2' AND attributes.status = 'FINISHED'") == []
    assert client.search_runs(["other"], "tags.`specws.pair_key` = 'k2'") == []
    client.log_metric(b, "x", 1.0, step=1)
    client.log_metric(b, "x", 2.0, step=2)
    assert client.get_run(b).data.metrics == {"x": 2.0}


def test_dry_run_sweep_recorded_offline_then_imported_with_links(tmp_path: Path, embedded_ready) -> None:
    offline = tmp_path / "offline"
    out = run_workspace("-m", "+option=A", "run.dry_run=true", "spec.num_draft_tokens=2,3",
                        f"tracking.uri=offline://{offline}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (ROOT / "mlruns" / "offline").exists()
    client, imp = import_into(offline, tmp_path)
    assert imp.returncode == 0, imp.stderr[-3000:]
    exp = client.get_experiment_by_name("smollm2_135m@local")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert sorted(c.data.params["spec.num_draft_tokens"] for c in children) == ["2", "3"]
    # importing again adds nothing
    _, again = import_into(offline, tmp_path)
    assert again.returncode == 0 and "already imported" in again.stdout
    assert len(client.search_runs([exp.experiment_id])) == 3


def test_import_refuses_a_folder_without_runs(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _, out = import_into(tmp_path / "empty", tmp_path)
    assert out.returncode != 0 and "holds no offline runs" in out.stderr
