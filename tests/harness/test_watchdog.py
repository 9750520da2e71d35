"""No engine outlives its runner: a runner killed without a chance to clean up (SIGKILL, SIGHUP) leaves no
server process behind; the watchdog takes the server's process group down."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from experiments.config.paths import ROOT

# SIGHUP at its default (termination) whatever this process inherited: under nohup it arrives ignored
RUNNER = """
import signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from tests.helpers.loopback_server import start_loopback
server = start_loopback(1, 1)
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_killed_runner_leaves_no_server(sig: int) -> None:
    runner = subprocess.Popen([sys.executable, "-c", RUNNER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    server_pid = int(runner.stdout.readline())
    assert psutil.pid_exists(server_pid)
    runner.send_signal(sig)
    runner.wait(10)
    assert _gone(server_pid, within_s=15), f"server {server_pid} outlived its runner ({signal.Signals(sig).name})"


def test_a_stopped_server_takes_its_watchdog_along() -> None:
    from tests.helpers.loopback_server import start_loopback

    server = start_loopback(1, 1)
    watchdog = server._watchdog
    assert watchdog is not None and watchdog.poll() is None
    server.stop()
    assert watchdog.poll() is not None
