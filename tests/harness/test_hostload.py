"""Host load around a level: real busy processes, inside and outside the runner's process tree. The machine has two
cores and may be shared, so the bounds leave room for other load."""
from __future__ import annotations

import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from experiments.harness.hostload import HostLoad, HostSampler, combine, host_loaded, parse_compute_apps
from tests.helpers.busy import BUSY, busy_outsider

WINDOW_S = 2.0


def _window(seconds: float = WINDOW_S) -> HostLoad:
    sampler = HostSampler.start()
    time.sleep(seconds)
    return sampler.stop()


@pytest.fixture
def outsider() -> Iterator[int]:
    with busy_outsider() as pid:
        yield pid


def test_a_busy_process_outside_the_runner_tree_keeps_one_other_core_busy(outsider: int) -> None:
    """Its CPU time over the window (read from the process itself) is in the others' and not in the runner's;
    an idle comparison would not hold here, where other runners may keep both cores busy."""
    assert outsider not in {p.pid for p in psutil.Process().children(recursive=True)}
    before = _cpu_s(outsider)
    busy = _window()
    ran = _cpu_s(outsider) - before
    assert ran > 0.3 * WINDOW_S                           # the loop got a share of the cores
    assert busy.other_cpu_s >= ran - 0.05                 # all of it counted as other (10 ms ticks)
    assert busy.own_cpu_s < 0.3                           # the sampling itself, a sleeping test
    assert 0.6 <= busy.other_cores_busy <= busy.cpus + 0.1
    assert busy.load1_start >= 0 and busy.load1_end >= 0 and 1.5 < busy.wall_s < 3.5


def test_the_runners_own_busy_thread_and_child_are_not_other() -> None:
    """A busy thread of this process, a busy child that exits (reaped) inside the window and one still running at
    its end: all the runner's and counted once, as the kernel's own account of this process and its children
    says (the running child is reaped right after the window)."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    before = _rusage_s()
    sampler = HostSampler.start()
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1: pass"])
    running = subprocess.Popen([sys.executable, "-c", BUSY])
    time.sleep(WINDOW_S)
    child.wait(timeout=30)
    stop.set()
    thread.join()
    load = sampler.stop()
    running.kill()
    running.wait(timeout=30)
    used = _rusage_s() - before
    assert used > 0.5                                     # the thread and the child did run
    assert abs(load.own_cpu_s - used) < 0.15              # a live child, a reaped one: each once


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _rusage_s() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def test_a_level_is_loaded_when_other_processes_hold_more_than_the_share() -> None:
    per_level = {1: {"host_other_cores_busy": 0.2}, 4: {"host_other_cores_busy": 0.9}}
    assert host_loaded(per_level, cpu_count=2, threshold_share=0.25)
    assert not host_loaded(per_level, cpu_count=4, threshold_share=0.25)
    assert host_loaded({"host_other_cores_busy_max": 0.9, "output_tok_s": 3.5}, cpu_count=2)
    assert not host_loaded({"host_other_cores_busy_c1": 0.1, "output_tok_s_c1": 3.5}, cpu_count=2)
    assert not host_loaded({"output_tok_s": 3.5}, cpu_count=2)     # a run from before: not known as loaded
    assert not host_loaded({}, cpu_count=2)


def test_repetitions_of_a_level_combine_into_one_window() -> None:
    a = HostLoad(2.0, 0.5, 1.0, 0.3, 0.4, 2, None)
    b = HostLoad(3.0, 0.5, 2.0, 0.5, 0.7, 2, 1)
    both = combine([a, b])
    assert both.wall_s == 5.0 and both.other_cores_busy == 3.0 / 5.0
    assert (both.load1_start, both.load1_end, both.other_gpu_procs) == (0.3, 0.7, 1)
    assert both.metrics() == {"host_load1_start": 0.3, "host_load1_end": 0.7, "host_other_cores_busy": 0.6,
                              "host_other_gpu_procs": 1.0}
    assert "host_other_gpu_procs" not in a.metrics() and combine([]) is None


def test_compute_apps_are_read_one_pid_per_process() -> None:
    text = "1234, 500 MiB\n1234, 300 MiB\n77, 10 MiB\n[N/A], [N/A]\n"
    assert parse_compute_apps(text) == {1234, 77} and parse_compute_apps("") == frozenset()
