"""experiments/harness/sweep.py: the swept parameter found among a sweep's children, what a job in another process
gets of the callback (the parent's id, not its store client), and a sweep's parent run in a real SQLite MLflow store
-- the file that names it for jobs elsewhere, and FAILED with its reason when a job failed."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.harness.sweep import PARENT_FILE, SweepCallback, _num, _parent_from_folder, swept_param
from experiments.tracking.store import PARENT_ENV


def _sweep_cfg(tmp: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", return_hydra_config=True, overrides=[
            *overrides, f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.artifact_root={tmp / 'artifacts'}",
            f"hydra.sweep.dir={tmp / 'sweep'}"])


def test_swept_param_prefers_speculation_and_workload_keys() -> None:
    params = [{"run.seed": "1", "model.dtype": "bf16", "spec.num_draft_tokens": "2", "engine.x": "a"},
              {"run.seed": "2", "model.dtype": "bf16", "spec.num_draft_tokens": "4", "engine.x": "b"}]
    assert swept_param(params) == "spec.num_draft_tokens"
    assert swept_param([{**p, "spec.num_draft_tokens": "4"} for p in params]) == "engine.x"


def test_swept_param_needs_two_children_and_a_difference_outside_run_keys() -> None:
    assert swept_param([{"spec.k": "1"}]) is None
    assert swept_param([{"run.seed": "1", "spec.k": "1"}, {"run.seed": "2", "spec.k": "1"}]) is None


def test_num_reads_numbers_and_keeps_names() -> None:
    assert _num("4") == 4.0 and _num("0.7") == 0.7
    assert _num("ngram") == "ngram"


def test_a_pickled_callback_carries_only_the_parent_and_the_launcher() -> None:
    cb = SweepCallback(on_end="x.y")
    cb.parent_id, cb.failed_jobs, cb.client = "abc123", 2, object()
    copy = pickle.loads(pickle.dumps(cb))
    assert (copy.parent_id, copy.launcher_pid) == ("abc123", os.getpid())
    assert (copy.client, copy.parent, copy.failed_jobs, copy.on_end) == (None, None, 0, None)


def test_a_sweep_without_an_option_starts_no_parent(tmp_path: Path) -> None:
    cfg = _sweep_cfg(tmp_path)
    cb = SweepCallback()
    cb.on_multirun_start(cfg)
    assert cb.parent is None and not (tmp_path / "sweep").exists()
    assert _parent_from_folder(Path(str(cfg.hydra.sweep.dir))) is None


def test_a_failed_job_fails_the_sweeps_parent_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(PARENT_ENV, raising=False)
    cfg = _sweep_cfg(tmp_path, "+option=A")
    cb = SweepCallback()
    cb.on_multirun_start(cfg)
    parent = cb.parent_id
    assert os.environ[PARENT_ENV] == parent
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    assert _parent_from_folder(sweep_dir) == parent == (sweep_dir / PARENT_FILE).read_text().strip()
    failed = JobReturn()
    failed.status = JobStatus.FAILED
    cb.on_job_end(cfg, failed)
    cb.on_multirun_end(cfg)
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(parent)
    assert run.info.status == "FAILED"
    assert run.data.tags["specws.failure"] == "1 of the sweep's runs failed"
    assert (run.data.tags["specws.sweep"], run.data.tags["specws.option"], run.data.tags["specws.children"]) == \
        ("parent", "A", "0")
    assert PARENT_ENV not in os.environ and cb.parent is None
