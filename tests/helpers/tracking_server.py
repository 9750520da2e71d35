"""The team's tracking server as the tests start it: PostgreSQL and `mlflow server` with proxied artifacts
(experiments.tracking.server_store, what bin/tracking-server runs), on free 127.0.0.1 ports in a temporary folder."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.tracking.server_store import PostgresMissing, TrackingServer, postgres_bin

# MLflow's client retries an unreachable server for ~4 min by default; the tests' runners give up after ~2 s
FAST_GIVE_UP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def require_postgres() -> None:
    """PostgreSQL's binaries, or the test fails in CI (CI=true) and is skipped elsewhere, saying what to install."""
    try:
        postgres_bin()
    except PostgresMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc}: .ci/run must install them before the tests")
        pytest.skip(f"{exc} (skipped outside CI)")


@contextmanager
def running_tracking_server() -> Iterator[TrackingServer]:
    require_postgres()
    folder = Path(tempfile.mkdtemp(prefix="specws-tracking-"))
    folder.chmod(0o755)   # as root, PostgreSQL runs as the postgres user, which must reach its folder
    server = TrackingServer(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def kill_mlflow(server: TrackingServer) -> None:
    """The MLflow server goes away at once (SIGKILL to its process group); PostgreSQL stays up."""
    server.mlflow.stop(signal.SIGKILL)


def restart_mlflow(server: TrackingServer) -> None:
    """The MLflow server back on the same URI (a kept write is keyed by it)."""
    if server.mlflow.proc is None or server.mlflow.proc.poll() is not None:
        server.mlflow.start()


def wait_for_run(client: MlflowClient, experiment: str, tag: str, timeout_s: float = 600) -> object:
    """The first RUNNING run of `experiment` that carries `tag`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") if exp else []
        found = [r for r in runs if tag in r.data.tags]
        if found:
            return found[0]
        time.sleep(1)
    raise TimeoutError(f"no RUNNING run with tag {tag} in {experiment} after {timeout_s:.0f} s")
