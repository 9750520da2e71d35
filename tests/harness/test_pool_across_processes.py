"""The engine-server pool across processes: two jobs on one host wait for each other's devices (a real file lock
per device, real processes, loopback servers), never share or stop each other's server, and never start on a port
another process is starting a server on; within one process a server is reused only for the same flags."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from filelock import FileLock

from experiments.config.paths import ROOT
from experiments.harness import server as server_module
from experiments.harness.devices import device_ids
from experiments.harness.launch import LaunchSpec
from experiments.harness.ports import free_port, hold_port
from experiments.harness.server import Server, ServerPool
from tests.helpers.loopback_server import MODULE


def _job(name: str, tmp: Path, go: Path) -> subprocess.Popen:
    env = {**os.environ, "SPECWS_LOCK_DIR": str(tmp / "locks"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.pool_job", name, str(go), str(tmp / f"{name}.log")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen, word: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(word):
            return line.split()[1:]
        if not line and proc.poll() is not None:
            break
    pytest.fail(f"no {word} line from pid {proc.pid}: {proc.stderr.read()[-2000:]}")


def test_second_job_waits_for_the_first_jobs_device_and_neither_stops_the_others_server(tmp_path: Path) -> None:
    go_first, go_second = tmp_path / "go-first", tmp_path / "go-second"
    first = _job("first", tmp_path, go_first)
    _, first_server, first_port = _line(first, "STARTED")
    second = _job("second", tmp_path, go_second)
    try:
        time.sleep(4.0)   # the second has started, and found the CPU device held
        assert second.poll() is None
        assert httpx.get(f"http://127.0.0.1:{first_port}/health", timeout=5).status_code == 200
        go_first.touch()
        _line(first, "ALIVE")                 # its own server, untouched while the other waited
        (done_first,) = _line(first, "DONE")
        started_second, second_server, second_port = _line(second, "STARTED")
        assert float(started_second) >= float(done_first), "the second server started while the first held the CPU"
        assert (second_server, second_port) != (first_server, first_port)
        go_second.touch()
        _line(second, "ALIVE")
        assert second.wait(timeout=30) == 0 and first.wait(timeout=30) == 0
        waited = second.stderr.read()
        assert f"waiting for device cpu on {os.uname().nodename}" in waited and f"held by pid {first.pid}" in waited
        assert "since" in waited and "device cpu free after" in waited
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def _loopback(name: str) -> LaunchSpec:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return LaunchSpec(engine="loopback", python=sys.executable, module=MODULE, health_path="/health", env=env,
                      args=["--ttft-ms", "1", "--itl-ms", "1", "--served-model-name", name])


def test_a_server_is_reused_only_for_the_same_flags(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECWS_LOCK_DIR", str(tmp_path / "locks"))
    pool = ServerPool()
    try:
        a, reused_a = pool.acquire(_loopback("a"), tmp_path / "a.log", 30, None, accelerator="cpu")
        again, reused_again = pool.acquire(_loopback("a"), tmp_path / "a2.log", 30, None, accelerator="cpu")
        b, reused_b = pool.acquire(_loopback("b"), tmp_path / "b.log", 30, None, accelerator="cpu")
        assert (reused_a, reused_again, reused_b) == (False, True, False)
        assert again is a and b is not a and b.spec.port != a.spec.port and a.alive() and b.alive()
    finally:
        pool.close_all()
    assert not a.alive() and not b.alive()
    FileLock(tmp_path / "locks" / "cpu.lock").acquire(timeout=0)   # the pool let the CPU go with its servers


def test_a_port_another_process_is_starting_a_server_on_is_skipped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECWS_LOCK_DIR", str(tmp_path / "locks"))
    taken = free_port()
    held = hold_port(tmp_path / "locks", taken)
    probe = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                            "from experiments.harness.ports import hold_port; "
                            f"print(hold_port(Path(sys.argv[1]), {taken}))", str(tmp_path / "locks")],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "None", probe.stderr   # another process cannot hold it meanwhile
    ports = iter([taken])
    monkeypatch.setattr(server_module, "free_port", lambda *a, **k: next(ports, None) or free_port())
    server = Server(_loopback("mine"), tmp_path / "mine.log")
    try:
        server.start(30, preferred_port=taken, health_poll_s=0.1)
        assert server.spec.port != taken
    finally:
        server.stop()
        held.release()


def test_device_sets(monkeypatch) -> None:
    monkeypatch.delenv("SLURM_STEP_GPUS", raising=False)
    monkeypatch.delenv("SLURM_JOB_GPUS", raising=False)
    assert device_ids("cpu", {"CUDA_VISIBLE_DEVICES": "0"}) == ["cpu"]   # the CPU engine is one device
    assert device_ids("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["gpu2", "gpu3"]
    monkeypatch.setenv("SLURM_JOB_GPUS", "4,5")   # a Slurm job's indices restart at 0: the node's are 4 and 5
    assert device_ids("cuda", {"CUDA_VISIBLE_DEVICES": "1"}) == ["gpu5"]
