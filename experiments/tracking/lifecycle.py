"""The one MLflow run lifecycle: create (tags, parent link, params), then a terminal state on every way out."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console

from experiments.tracking.store import PARENT_ENV, log_params

console = Console(stderr=True)
FAILURE_TAG = "specws.failure"


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
    tags = {**tags, **({"mlflow.runName": name} if name else {}),
            **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    created = client.create_run(experiment_id, run_name=name, tags=tags, start_time=start_time)
    run = TrackedRun(client, created.info.run_id)
    try:
        if params:
            log_params(client, run.id, params)
        yield run
    except KeyboardInterrupt:
        _end(run, "KILLED", "interrupted (Ctrl-C / SIGTERM)")
        raise
    except BaseException as exc:
        _end(run, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    else:
        _end(run, run.status, run.reason, strict=True)


def _end(run: TrackedRun, status: str, reason: str, strict: bool = False) -> None:
    try:
        if reason:
            run.client.set_tag(run.id, FAILURE_TAG, reason[:5000])
        run.client.set_terminated(run.id, status, end_time=run.end_time)
    except Exception as exc:  # noqa: BLE001 - the store is the thing that failed
        console.print(f"[bold red]could not mark run {run.id} {status} in the store[/]: {exc}")
        if strict:
            raise
