"""Hydra callback: one MLflow parent run per multirun sweep, children per job, a summary plot on the
parent, and the shared server pool closed at the end."""
from __future__ import annotations

import atexit
import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.config import paths  # noqa: F401  (registers the ws.* resolvers)
from experiments.tracking.store import PARENT_ENV, git_commit, setup

SWEEP_KEYS_PREFERRED = ("spec.", "workload.")


class SweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_id: str | None = None
        self.client = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("option") is None:
            return
        self.client, exp_id = setup(config)
        overrides = " ".join(config.hydra.overrides.task)
        run = self.client.create_run(exp_id, run_name=f"sweep-{config.option.name}", tags={
            "specws.sweep": "parent", "specws.option": config.option.name,
            "specws.site": config.site.name, "specws.sweep_overrides": overrides, "git.commit": git_commit()})
        self.parent_id = run.info.run_id
        os.environ[PARENT_ENV] = self.parent_id
        atexit.register(self._abandon)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments.harness.server import POOL

        POOL.close_all()
        if self.parent_id is None:
            return
        children = self.client.search_runs(
            [self.client.get_run(self.parent_id).info.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{self.parent_id}'")
        measured = [r for r in children if r.data.tags.get("specws.option") != "baseline"
                    and r.info.status == "FINISHED" and r.data.tags.get("specws.mode") == "measure"]
        param = swept_param([r.data.params for r in measured])
        if param and measured:
            from experiments.tracking.plots import sweep_figure

            rows = [{"x": _num(r.data.params[param]), **r.data.metrics} for r in measured]
            self.client.log_figure(self.parent_id, sweep_figure(param, rows), "plots/sweep.png")
            self.client.log_dict(self.parent_id, rows, "sweep.json")
            self.client.set_tag(self.parent_id, "specws.swept_param", param)
        failed = [r for r in children if r.info.status != "FINISHED"]
        self.client.set_tag(self.parent_id, "specws.children", str(len(children)))
        self.client.set_terminated(self.parent_id, "FAILED" if failed else "FINISHED")
        self.parent_id = None
        os.environ.pop(PARENT_ENV, None)

    def _abandon(self) -> None:
        """The sweep ended without on_multirun_end (Ctrl-C, crash): mark the parent KILLED."""
        if self.parent_id is not None:
            self.client.set_terminated(self.parent_id, "KILLED")
            self.parent_id = None


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
