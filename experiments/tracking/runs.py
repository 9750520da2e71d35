"""Opening the store and a run: `setup` points MLflow (or the offline store) at tracking.uri, records the ends a
failing store could not take and fails stale runs; `open_run` is setup -> tags -> the one run lifecycle, the way
every run of the workspace is opened."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from experiments.config.views import RunView, TrackingView
from experiments.tracking.console_guard import redact_logs
from experiments.tracking.lifecycle import TrackedRun, apply_pending_ends, fail_stale_runs, tracked_run
from experiments.tracking.offline_store import URI_PREFIX, OfflineClient
from experiments.tracking.redact import register_secrets, secrets_of_environ
from experiments.tracking.redacting import RedactingClient
from experiments.tracking.spool import SpoolingClient, apply_spooled, spools
from experiments.tracking.store import flatten, mlflow, register_config_secrets, run_tags, sqlite_file


@contextmanager
def open_run(run: RunView, mode: str, name: str, tags: dict[str, str] | None = None,
             params: dict[str, str] | None = None, **lifecycle: Any) -> Iterator[TrackedRun]:
    """A run in its experiment: the workspace's tags for `mode` (run_tags), the config's own `run.tags`, then
    `tags`; the flattened config as params unless `params` is given; ended by `tracked_run` on every way out
    (`lifecycle`: its parent_id, start_time, store_retry_s). `run.client` is the store's client."""
    if run.config is not None:
        register_config_secrets(run.config)
    client, exp_id = setup(run.tracking)
    user = {k: str(v) for k, v in run.run.tags.items()}
    with tracked_run(client, exp_id, name, run_tags(run, mode) | user | (tags or {}),
                     flatten(run.config) if params is None else params, **lifecycle) as tracked:
        yield tracked


@contextmanager
def _store_lock(uri: str):
    """Serialise first use of a SQLite store: MLflow creates its schema on first contact, and two
    processes doing that at once fail with 'table ... already exists'."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def setup(tracking: TrackingView) -> tuple[Any, str]:
    """Point MLflow at the configured store; the experiment is created with its artifact folder.
    An `offline://<folder>` URI records into plain files instead (experiments.tracking.offline_store).
    The client redacts what it writes: the secrets of this process's environment included (`open_run` registers the
    config's); on a tracking server (http(s)) or a SQLite file it spools a run's writes to disk once
    the store fails (tracking.spool). Log records are redacted from here on, and MLflow prints no run URL
    (tracking.console_guard)."""
    redact_logs()
    register_secrets(secrets_of_environ(os.environ))
    uri = tracking.uri
    if uri.startswith(URI_PREFIX):
        client = RedactingClient(OfflineClient(uri.removeprefix(URI_PREFIX)))
        _fail_stale_once(client, uri, tracking.experiment)
        return client, tracking.experiment
    if mlflow is None:
        raise RuntimeError(f"MLflow is not installed here; use tracking.uri={URI_PREFIX}<folder> and import the "
                           "runs elsewhere with `python -m experiments.tracking.import_runs <folder>`")
    mlflow.set_tracking_uri(uri)
    from mlflow.tracking import MlflowClient

    with _store_lock(uri):
        plain_client = MlflowClient()
        client = RedactingClient(SpoolingClient(plain_client, uri) if spools(uri) else plain_client)
        exp_id = _experiment_id(client, tracking)
    _fail_stale_once(client, uri, exp_id, plain_client)
    return client, exp_id


_checked_for_stale: set[tuple[str, str]] = set()


def _fail_stale_once(client, uri: str, experiment_id: str, plain_client=None) -> None:
    """At a runner's first contact with an experiment: the ends a failing store could not take, and the writes a
    tracking server could not take (through the unwrapped `plain_client`), are recorded, then runs left RUNNING
    by a runner that is gone become FAILED."""
    if (uri, experiment_id) in _checked_for_stale:
        return
    _checked_for_stale.add((uri, experiment_id))
    if not uri.startswith(URI_PREFIX):
        apply_pending_ends(client)   # first: a run with a kept end is not a stale one
    if spools(uri):
        apply_spooled(plain_client, uri)
    fail_stale_runs(client, experiment_id)


def _experiment_id(client, tracking: TrackingView) -> str:
    """The experiment's id, created if missing: on a shared server another runner may create it between the lookup
    and the creation (RESOURCE_ALREADY_EXISTS), and then its id is the one."""
    name = tracking.experiment
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if tracking.artifact_root:
        root = Path(tracking.artifact_root)
        root.mkdir(parents=True, exist_ok=True)
        location = (root / name.replace("/", "_")).as_uri()
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as exc:
        exp = client.get_experiment_by_name(name)
        if exc.error_code != "RESOURCE_ALREADY_EXISTS" or exp is None:
            raise
        return exp.experiment_id


