"""`python -m experiments.harness.watchdog <runner pid> <runner start time> <engine pgid>`: takes an engine's
process group down when the runner that started it is gone -- SIGKILL, SIGHUP, the OOM killer, anything that
leaves no chance to clean up. It runs in a session of its own, so a signal to the runner's group does not reach
it, and ends by itself when the engine's group is gone."""
from __future__ import annotations

import os
import signal
import sys
import time

from experiments.tracking.processes import same_process

POLL_S = 1.0
GRACE_S = 5.0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def take_down(pgid: int) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.2)


def watch(runner_pid: int, runner_start: float, pgid: int) -> None:
    while group_alive(pgid):
        if not same_process(runner_pid, runner_start):
            take_down(pgid)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
