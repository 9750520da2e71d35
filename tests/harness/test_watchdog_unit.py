"""experiments/harness/watchdog.py's functions on real process groups (tests/harness/test_watchdog.py kills real
runners): whether a group lives, taking one down (SIGTERM, then SIGKILL for one that ignores it), and `watch`
taking the group down once its runner is not the recorded process, returning by itself once the group is gone."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from experiments.harness import watchdog
from experiments.harness.watchdog import group_alive, take_down, watch

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(60)"


def _group(code: str = "import time; print('ready', flush=True); time.sleep(60)") -> subprocess.Popen:
    """A process leading a group of its own, reaped by a thread as soon as it ends (a zombie still counts)."""
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


@pytest.fixture
def group() -> Iterator[subprocess.Popen]:
    proc = _group()
    yield proc
    if proc.poll() is None:
        proc.kill()


def test_a_running_group_is_alive_and_a_gone_one_is_not(group: subprocess.Popen) -> None:
    assert group_alive(group.pid) is True
    group.kill()
    group.wait(timeout=10)
    assert group_alive(group.pid) is False


def test_take_down_ends_the_group_with_sigterm(group: subprocess.Popen) -> None:
    t0 = time.monotonic()
    take_down(group.pid)
    assert time.monotonic() - t0 < 2.0
    assert group.wait(timeout=5) == -15 and not group_alive(group.pid)


def test_take_down_kills_a_group_that_ignores_sigterm_after_the_grace() -> None:
    proc = _group(IGNORES_TERM)
    t0 = time.monotonic()
    take_down(proc.pid)
    assert proc.wait(timeout=5) == -9
    assert time.monotonic() - t0 >= watchdog.GRACE_S - 0.5


def test_take_down_of_a_gone_group_returns_at_once(group: subprocess.Popen) -> None:
    group.kill()
    group.wait(timeout=10)
    take_down(group.pid)     # no ProcessLookupError


def test_watch_takes_the_group_down_when_the_runner_is_not_the_recorded_one(group: subprocess.Popen) -> None:
    start = psutil.Process().create_time()
    watch(os.getpid(), start - 100.0, group.pid)     # this pid, another start time: a reused pid
    assert group.wait(timeout=5) == -15


def test_watch_ends_by_itself_when_the_group_is_gone(group: subprocess.Popen) -> None:
    threading.Timer(0.5, group.terminate).start()
    t0 = time.monotonic()
    watch(os.getpid(), psutil.Process().create_time(), group.pid)   # the runner lives on
    assert time.monotonic() - t0 < 5.0 and group.returncode == -15
