"""Hydra callback: one MLflow parent run per multirun sweep, children per job, a summary plot on the
parent, and the shared server pool closed at the end.

Whichever launcher runs the jobs: the basic launcher runs them in this process; submitit's (submitit_local, a Slurm
cluster) unpickles this callback in a process of each job, which finds the parent run by the pickled id, else by
the file the sweep wrote into its folder before any job started, and closes its own servers when its job ends."""
from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.config import paths  # noqa: F401  (registers the ws.* resolvers)
from experiments.config.views import tracking_view
from experiments.tracking.lifecycle import TrackedRun, tracked_run
from experiments.tracking.runs import setup
from experiments.tracking.store import PARENT_ENV, git_commit, register_config_secrets

SWEEP_KEYS_PREFERRED = ("spec.", "workload.")
PARENT_FILE = "parent_run_id"   # in the sweep folder: the parent run, for jobs that run elsewhere


class SweepCallback(Callback):
    """The parent run lives from the first job to the last; a failed job fails it, a sweep that ends without
    reaching on_multirun_end (Ctrl-C, crash) leaves it KILLED, or FAILED when a job had failed."""

    def __init__(self, on_end: str | None = None) -> None:
        self.on_end = on_end   # dotted name of `f(client, parent_run_id)`, run when the sweep ends (its verdict)
        self.parent: TrackedRun | None = None
        self._run_cm = None
        self.failed_jobs = 0
        self.client = None
        self.launcher_pid = os.getpid()
        self.parent_id: str | None = None

    def __getstate__(self) -> dict:
        """What a job in another process gets (submitit pickles the launcher and its callbacks): the parent's id,
        not its open run and store client."""
        return {"launcher_pid": self.launcher_pid, "parent_id": self.parent_id}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.launcher_pid, self.parent_id = state["launcher_pid"], state["parent_id"]

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("option") is None:
            return
        register_config_secrets(config)
        self.client, exp_id = setup(tracking_view(config))
        overrides = " ".join(config.hydra.overrides.task)
        self._run_cm = tracked_run(self.client, exp_id, f"sweep-{config.option.name}", {
            "specws.sweep": "parent", "specws.option": config.option.name,
            "specws.site": config.site.name, "specws.sweep_overrides": overrides, "git.commit": git_commit()})
        self.parent = self._run_cm.__enter__()
        self.parent_id = self.parent.id
        os.environ[PARENT_ENV] = self.parent.id
        folder = Path(str(config.hydra.sweep.dir))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PARENT_FILE).write_text(self.parent.id + "\n")
        atexit.register(self._abandon)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._elsewhere() and not os.environ.get(PARENT_ENV):
            parent = self.parent_id or _parent_from_folder(Path(str(config.hydra.sweep.dir)))
            if parent:
                os.environ[PARENT_ENV] = parent

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.FAILED:
            self.failed_jobs += 1
        if self._elsewhere():   # this process ends with its job: so do its servers
            from experiments.harness.server import POOL

            POOL.close_all()

    def _elsewhere(self) -> bool:
        """The job runs in a process of its own (submitit), not in the launcher's."""
        return os.getpid() != self.launcher_pid

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments.harness.server import POOL

        POOL.close_all()
        if self.parent is None:
            return
        children = self.client.search_runs(
            [self.client.get_run(self.parent.id).info.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{self.parent.id}'")
        self._log_sweep(children)
        if self.on_end:
            from hydra.utils import get_method
            get_method(self.on_end)(self.client, self.parent.id)
        failed = [r for r in children if r.info.status != "FINISHED"]
        self.client.set_tag(self.parent.id, "specws.children", str(len(children)))
        if failed or self.failed_jobs:   # a job elsewhere counts its failure in its own process: read the runs
            self.parent.finish_as("FAILED", f"{max(len(failed), self.failed_jobs)} of the sweep's runs failed")
        self._close(None)

    def _log_sweep(self, children: list) -> None:
        measured = [r for r in children if r.data.tags.get("specws.spec_method", "none") != "none"
                    and r.info.status == "FINISHED" and r.data.tags.get("specws.mode") == "measure"]
        param = swept_param([r.data.params for r in measured])
        if param and measured:
            from experiments.tracking.plots import sweep_figure

            rows = [{"x": _num(r.data.params[param]), **r.data.metrics} for r in measured]
            self.client.log_figure(self.parent.id, sweep_figure(param, rows), "plots/sweep.png")
            self.client.log_dict(self.parent.id, rows, "sweep.json")
            self.client.set_tag(self.parent.id, "specws.swept_param", param)

    def _close(self, exc: BaseException | None) -> None:
        cm, self._run_cm, self.parent = self._run_cm, None, None
        os.environ.pop(PARENT_ENV, None)
        if cm is not None:
            cm.__exit__(type(exc) if exc else None, exc, None)

    def _abandon(self) -> None:
        """The sweep ended without on_multirun_end: a failed job (Hydra stops the sweep by raising it) fails the
        parent; otherwise the sweep was interrupted."""
        if self.parent is None:
            return
        failed = self.failed_jobs or self._failed_children()
        self._close(RuntimeError(f"{failed} sweep job(s) failed") if failed
                    else KeyboardInterrupt("the sweep ended before its last job"))

    def _failed_children(self) -> int:
        """Children that ended FAILED (jobs in other processes count their failures there, not here)."""
        try:
            exp = self.client.get_run(self.parent.id).info.experiment_id
            children = self.client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{self.parent.id}'")
        except Exception:  # noqa: BLE001 - the store is gone: the parent ends as interrupted
            return 0
        return sum(r.info.status == "FAILED" for r in children)


def _parent_from_folder(sweep_dir: Path) -> str | None:
    path = sweep_dir / PARENT_FILE
    return path.read_text().strip() if path.exists() else None


def swept_param(params: list[dict[str, str]]) -> str | None:
    """The parameter that differs between children (speculation and workload keys first)."""
    if len(params) < 2:
        return None
    varying = [k for k in params[0] if len({p.get(k) for p in params}) > 1 and not k.startswith("run.")]
    varying.sort(key=lambda k: (not k.startswith(SWEEP_KEYS_PREFERRED), k))
    return varying[0] if varying else None


def _num(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value
