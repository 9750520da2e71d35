"""The team's tracking server as the tests start it: PostgreSQL and `mlflow server` with proxied artifacts
(experiments.tracking.server_store, what bin/tracking-server runs), on free 127.0.0.1 ports in a temporary folder."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.tracking.server_store import PostgresMissing, TrackingServer, free_port, postgres_bin
from experiments.tracking.spool import spool_root

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
        shutil.rmtree(spool_root(server.uri), ignore_errors=True)   # nothing can record it once the server is gone


def kill_mlflow(server: TrackingServer) -> None:
    """The MLflow server goes away at once (SIGKILL to its process group); PostgreSQL stays up."""
    server.mlflow.stop(signal.SIGKILL)


def restart_mlflow(server: TrackingServer) -> None:
    """The MLflow server back on the same URI (a kept write is keyed by it)."""
    if server.mlflow.proc is None or server.mlflow.proc.poll() is not None:
        server.mlflow.start()


def wait_for_run(client: MlflowClient, experiment: str, name: str, tag: str, proc: subprocess.Popen,
                 timeout_s: float = 600) -> object:
    """The RUNNING run `name` of `experiment` once it carries `tag` (while `proc`, its runner, lives)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], f"attributes.status = 'RUNNING' and "
                                                       f"tags.`mlflow.runName` = '{name}'") if exp else []
        if runs and tag in runs[0].data.tags:
            return runs[0]
        time.sleep(0.5)
    raise TimeoutError(f"no RUNNING run {name} with tag {tag} in {experiment} (runner exit {proc.poll()})")


class TeamServer:
    """`bin/tracking-server <folder>` as the team runs it, on a free 127.0.0.1 port; started again on the same
    folder and port after it went away."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300) -> None:
        require_postgres()
        with open(self.folder.parent / f"{self.folder.name}-script.log", "a") as log:
            self.proc = subprocess.Popen([str(ROOT / "bin" / "tracking-server"), str(self.folder), "--host",
                                          "127.0.0.1", "--port", str(self.port), "--workers", "2"],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.uri}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        raise RuntimeError(f"bin/tracking-server not healthy at {self.uri} (exit {self.proc.poll()})")

    def kill_mlflow(self) -> int:
        """SIGKILL to the MLflow server's process group, as a crash would; the script then stops PostgreSQL and
        exits. Returns its exit status."""
        (child,) = [p for p in psutil.Process(self.proc.pid).children() if "mlflow" in " ".join(p.cmdline())]
        os.killpg(child.pid, signal.SIGKILL)
        return self.proc.wait(timeout=120)

    def stop(self) -> int | None:
        shutil.rmtree(spool_root(self.uri), ignore_errors=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            return self.proc.wait(timeout=120)
        return self.proc.returncode if self.proc else None
