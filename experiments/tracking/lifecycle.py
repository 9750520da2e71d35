"""The one MLflow run lifecycle: create (tags, parent link, params), then a terminal state on every way out."""
from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from rich.console import Console

from experiments.config.paths import cache_dir
from experiments.tracking.processes import same_process
from experiments.tracking.redact import redact_params, redact_text
from experiments.tracking.store import PARENT_ENV, log_params, sqlite_file

console = Console(stderr=True)
FAILURE_TAG = "specws.failure"
RUNNER_TAG = "specws.runner"            # pid:start time of the process that owns the run
RUNNER_HOST_TAG = "specws.runner_host"
# How long a run's terminal state is retried against a store that fails (SQLite locked by another process:
# MLflow itself waits 20 s per write first); then it is kept on disk for the next start (`apply_pending_ends`).
STORE_RETRY_S = 60.0
SYSTEM_METRICS_TAG = "telemetry.system"
SYSTEM_METRICS_INTERVAL_S = 10.0   # MLflow's own default: CPU, memory, disk and network as system/* metrics
SYSTEM_METRICS_FINISH_S = 2.0
NOTE_TAG = "mlflow.note.content"              # an experiment's (or a run's) description in the MLflow UI
OPTIONS_TAG = "specws.options_measured"       # the options the experiment's description names (ours when set)
DESCRIBED_MODES = ("measure", "forecast")


class StoreUnavailable(RuntimeError):
    """The tracking store refused to create a run, or to record how one ended (kept on disk for later)."""


@dataclass
class TrackedRun:
    """A run inside `tracked_run`; `finish_as` sets the state a normal exit ends it in (default FINISHED)."""
    client: object
    id: str
    status: str = "FINISHED"
    end_time: int | None = None
    reason: str = ""
    store_retry_s: float = STORE_RETRY_S

    def finish_as(self, status: str, reason: str = "", end_time: int | None = None) -> None:
        self.status, self.reason, self.end_time = status, reason, end_time


@contextmanager
def tracked_run(client, experiment_id: str, name: str | None, tags: dict[str, str],
                params: dict[str, str] | None = None, parent_id: str | None = None,
                start_time: int | None = None, store_retry_s: float = STORE_RETRY_S,
                system_metrics: bool = True) -> Iterator[TrackedRun]:
    """Create a run and end it on every exit path: FINISHED (or what `finish_as` set), KILLED on Ctrl-C /
    SIGTERM (KeyboardInterrupt), FAILED on any other exception with its reason in `specws.failure`. The parent
    is `parent_id`, else the sweep parent named by SPECWS_PARENT_RUN_ID.

    A store that fails while ending the run is retried for `store_retry_s`; if it is still failing, the terminal
    state (status, reason, end time) is written to disk and recorded by the next start on that store, never
    left RUNNING, and the store's failure never hides the exception that ended the run (a normal exit raises
    StoreUnavailable instead).

    While it runs, MLflow's system-metrics monitor logs the host's CPU, memory, disk and network (and GPUs where
    NVML works) as `system/*` metrics; `system_metrics=False` for a run that records another machine's (an
    import). The `telemetry.system` tag says whether it ran, and why not."""
    parent_id = parent_id or os.environ.get(PARENT_ENV)
    monitor_off = _system_metrics_off(client) if system_metrics else "off: not this run's machine (imported)"
    system = monitor_off or f"on: MLflow system metrics every {SYSTEM_METRICS_INTERVAL_S:g} s"
    tags = {SYSTEM_METRICS_TAG: system, **tags, **runner_tags(), **({"mlflow.runName": name} if name else {}),
            **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    try:
        created = client.create_run(experiment_id, run_name=name, tags=redact_params(tags), start_time=start_time)
    except Exception as exc:  # noqa: BLE001 - whatever the store raises, nothing has started yet
        raise StoreUnavailable(f"the tracking store {_uri_of(client)} could not create run {name!r} "
                               f"({_brief(exc)}); nothing was started") from exc
    run = TrackedRun(client, created.info.run_id, store_retry_s=store_retry_s)
    describe_experiment(client, experiment_id, tags)
    monitor = None if monitor_off else _start_system_metrics(client, run.id)
    try:
        if params:
            log_params(client, run.id, params)
        yield run
    except GeneratorExit:  # abandoned without an exit (garbage collected): the next start finds it stale
        raise
    except KeyboardInterrupt:
        _finish_system_metrics(monitor)
        _end(run, "KILLED", "interrupted (Ctrl-C / SIGTERM)")
        raise
    except BaseException as exc:
        _finish_system_metrics(monitor)
        _end(run, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    else:
        _finish_system_metrics(monitor)
        _end(run, run.status, run.reason, strict=True)


def describe_experiment(client, experiment_id: str, tags: dict[str, str]) -> None:
    """The experiment's description (its `mlflow.note.content` tag): what it holds, model@site and the options
    measured in it; written by the first run of an option it does not name yet, never over a description someone
    else wrote, never failing the run (the offline store has no experiment tags)."""
    option = tags.get("specws.option")
    if not option or tags.get("specws.mode") not in DESCRIBED_MODES or not hasattr(client, "set_experiment_tag"):
        return
    try:
        exp = client.get_experiment(experiment_id)
        named = exp.tags.get(OPTIONS_TAG)
        if (named is None and NOTE_TAG in exp.tags) or (named is not None and option in named.split(",")):
            return
        options = sorted({*(named.split(",") if named else []), option}, key=lambda o: (o != "baseline", o))
        client.set_experiment_tag(experiment_id, OPTIONS_TAG, ",".join(options))
        client.set_experiment_tag(experiment_id, NOTE_TAG, experiment_note(exp.name, tags, options))
    except Exception as exc:  # noqa: BLE001 - a description never fails a run
        console.print(f"[yellow]the experiment's description was not written[/]: {_brief(exc)}")


def experiment_note(name: str, tags: dict[str, str], options: list[str]) -> str:
    """Markdown: what the experiment holds and where to look."""
    model, site = tags.get("specws.model", "?"), tags.get("specws.site", "?")
    return (f"**{name}**: speculative-decoding measurements of {model} served on site {site}, each option paired "
            f"with a baseline of the same engine, model and workload.\n\n"
            f"Options measured: {', '.join(options)}. Each run's description starts with its verdict "
            "(`Verdict: ...`); the `decision_*` metrics carry it per concurrency level.\n\n"
            f"Decision report: `.venv/bin/python -m experiments.analysis.report {shlex.quote(name)}`")


def _system_metrics_off(client) -> str | None:
    """Why MLflow's system-metrics monitor cannot run against `client`'s store; None when it can."""
    if not getattr(client, "tracking_uri", None):
        return "off: offline store (no MLflow here); the measured levels keep the host's CPU in telemetry/"
    try:
        import mlflow.system_metrics.system_metrics_monitor  # noqa: F401
    except ImportError as exc:
        return f"off: MLflow's system-metrics monitor is missing ({exc})"
    return None


def _start_system_metrics(client, run_id: str):
    """MLflow's monitor of this run, sampling in its own thread; None (and the tag says why) if it fails."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)   # not two INFO lines per run
    try:
        monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S,
                                       tracking_uri=str(client.tracking_uri))
        monitor.start()
    except Exception as exc:  # noqa: BLE001 - the run goes on without them
        client.set_tag(run_id, SYSTEM_METRICS_TAG, f"off: the monitor did not start ({_brief(exc)})")
        return None
    return monitor


def _finish_system_metrics(monitor) -> None:
    """Stop the monitor before the run ends (a run shorter than one interval still logs one sample), waiting at
    most SYSTEM_METRICS_FINISH_S: a locked or unreachable store holds the monitor's writes, not the run's end."""
    if monitor is None:
        return

    def finish() -> None:
        try:
            monitor.finish()
            if getattr(monitor, "_logging_step", 1) == 0:
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
        except Exception as exc:  # noqa: BLE001 - system metrics never fail a run
            console.print(f"[yellow]system metrics not logged[/]: {_brief(exc)}")

    worker = threading.Thread(target=finish, daemon=True, name="system-metrics-finish")
    worker.start()
    worker.join(SYSTEM_METRICS_FINISH_S)


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
    end_time = run.end_time or int(time.time() * 1000)
    try:
        _retrying(lambda: _write_end(run.client, run.id, status, reason, end_time), run.store_retry_s)
    except Exception as exc:  # noqa: BLE001 - the store is the thing that failed
        message = (f"the tracking store {_uri_of(run.client)} could not record run {run.id} {status} "
                   f"after {run.store_retry_s:.0f} s of retries ({_brief(exc)})")
        try:
            pending = _save_pending_end(run.client, run.id, status, reason, end_time)
        except OSError as disk:   # the disk is failing too: the next start fails the run as stale
            pending, message = None, f"{message}; could not keep it on disk either ({disk})"
        if pending is not None:
            message += f"; kept in {pending}: the next run on this store records it"
        console.print(f"[bold red]{message}[/]")
        if strict:
            raise StoreUnavailable(message) from exc


def _write_end(client, run_id: str, status: str, reason: str, end_time: int | None) -> None:
    if reason:
        client.set_tag(run_id, FAILURE_TAG, redact_text(reason)[:5000])
    client.set_terminated(run_id, status, end_time=end_time)


def _retrying(write: Callable[[], None], retry_s: float) -> None:
    """`write` until it succeeds, backing off up to 5 s between attempts, for `retry_s` seconds at most."""
    deadline, pause = time.monotonic() + retry_s, 0.5
    while True:
        try:
            write()
            return
        except Exception:  # noqa: BLE001
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _brief(exc: Exception) -> str:
    """The exception's first line: SQLAlchemy's errors go on with the whole SQL statement."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _uri_of(client) -> str:
    return redact_text(str(getattr(client, "tracking_uri", None) or getattr(client, "root", "?")))


def pending_dir(uri: str) -> Path:
    """Where terminal states a store could not take wait: next to a SQLite file, else in the cache."""
    db = sqlite_file(uri)
    return db.parent / f"{db.name}.pending-ends" if db is not None else cache_dir() / "pending-ends"


def _save_pending_end(client, run_id: str, status: str, reason: str, end_time: int) -> Path | None:
    uri = getattr(client, "tracking_uri", None)
    if not uri:   # the offline store is plain files: nothing to keep them in if those fail
        return None
    folder = pending_dir(uri)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"uri": uri, "run_id": run_id, "status": status, "reason": redact_text(reason),
                               "end_time": end_time}))
    tmp.replace(path)
    return path


def apply_pending_ends(client) -> list[str]:
    """Record the terminal states kept on disk for this client's store (see `_end`) in runs still RUNNING
    there; each file is removed once recorded. Returns the run ids."""
    uri = str(client.tracking_uri)
    folder = pending_dir(uri)
    done = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        end = json.loads(path.read_text())
        if end["uri"] != uri:
            continue
        try:
            status = client.get_run(end["run_id"]).info.status
        except Exception as exc:  # noqa: BLE001 - a run deleted since, or the store failing again
            console.print(f"[yellow]kept the end of run {end['run_id']} in {path}[/]: {exc}")
            continue
        if status == "RUNNING":
            _write_end(client, end["run_id"], end["status"], end["reason"], end["end_time"])
            done.append(end["run_id"])
        path.unlink()
    if done:
        console.print(f"recorded the end of {len(done)} run(s) the store could not take earlier: {', '.join(done)}")
    return done
