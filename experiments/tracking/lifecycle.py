"""The one MLflow run lifecycle: create (tags, parent link, params), then a terminal state on every way out."""
from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
from rich.console import Console

from experiments.tracking.processes import same_process
from experiments.tracking.redact import redact_params, redact_text
from experiments.tracking.store import PARENT_ENV, log_params

console = Console(stderr=True)
FAILURE_TAG = "specws.failure"
RUNNER_TAG = "specws.runner"            # pid:start time of the process that owns the run
RUNNER_HOST_TAG = "specws.runner_host"


@dataclass
class TrackedRun:
    """A run inside `tracked_run`; `finish_as` sets the state a normal exit ends it in (default FINISHED)."""
    client: object
    id: str
    status: str = "FINISHED"
    end_time: int | None = None
    reason: str = ""

    def finish_as(self, status: str, reason: str = "", end_time: int | None = None) -> None:
        self.status, self.reason, self.end_time = status, reason, end_time


@contextmanager
def tracked_run(client, experiment_id: str, name: str | None, tags: dict[str, str],
                params: dict[str, str] | None = None, parent_id: str | None = None,
                start_time: int | None = None) -> Iterator[TrackedRun]:
    """Create a run and end it on every exit path: FINISHED (or what `finish_as` set), KILLED on Ctrl-C /
    SIGTERM (KeyboardInterrupt), FAILED on any other exception with its reason in `specws.failure`. The parent
    is `parent_id`, else the sweep parent named by SPECWS_PARENT_RUN_ID. A store that fails while ending the run
    is reported and never hides the exception that ended it."""
    parent_id = parent_id or os.environ.get(PARENT_ENV)
    tags = {**tags, **runner_tags(), **({"mlflow.runName": name} if name else {}),
            **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    created = client.create_run(experiment_id, run_name=name, tags=redact_params(tags), start_time=start_time)
    run = TrackedRun(client, created.info.run_id)
    try:
        if params:
            log_params(client, run.id, params)
        yield run
    except GeneratorExit:  # abandoned without an exit (garbage collected): the next start finds it stale
        raise
    except KeyboardInterrupt:
        _end(run, "KILLED", "interrupted (Ctrl-C / SIGTERM)")
        raise
    except BaseException as exc:
        _end(run, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    else:
        _end(run, run.status, run.reason, strict=True)


def runner_tags() -> dict[str, str]:
    """Which process owns a RUNNING run: the next start on this host fails it if that process is gone."""
    me = psutil.Process()
    return {RUNNER_HOST_TAG: platform.node(), RUNNER_TAG: f"{me.pid}:{me.create_time():.2f}"}


def fail_stale_runs(client, experiment_id: str) -> list[str]:
    """RUNNING runs started on this host whose runner process is gone (SIGKILL, OOM, a lost machine): FAILED,
    with the reason. Returns their ids."""
    query = f"tags.`{RUNNER_HOST_TAG}` = '{platform.node()}' and attributes.status = 'RUNNING'"
    stale = []
    for run in client.search_runs([experiment_id], filter_string=query):
        pid, _, started = run.data.tags.get(RUNNER_TAG, "").partition(":")
        if pid.isdigit() and not same_process(int(pid), float(started or 0)):
            client.set_tag(run.info.run_id, FAILURE_TAG, f"its runner (pid {pid}) ended without closing it")
            client.set_terminated(run.info.run_id, "FAILED")
            stale.append(run.info.run_id)
    if stale:
        console.print(f"marked {len(stale)} run(s) FAILED whose runner is gone: {', '.join(stale)}")
    return stale


def _end(run: TrackedRun, status: str, reason: str, strict: bool = False) -> None:
    try:
        if reason:
            run.client.set_tag(run.id, FAILURE_TAG, redact_text(reason)[:5000])
        run.client.set_terminated(run.id, status, end_time=run.end_time)
    except Exception as exc:  # noqa: BLE001 - the store is the thing that failed
        console.print(f"[bold red]could not mark run {run.id} {status} in the store[/]: {exc}")
        if strict:
            raise
