"""experiments/tracking/processes.py: a recorded process is still the same one only with its pid and its start
time; a pid reused by another process (another start time) or gone is not."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil

from experiments.tracking.processes import same_process


def test_this_process_is_itself() -> None:
    assert same_process(os.getpid(), psutil.Process().create_time()) is True


def test_another_start_time_is_another_process() -> None:
    start = psutil.Process().create_time()
    assert same_process(os.getpid(), start - 5.0) is False
    assert same_process(os.getpid(), start + 1.5) is False


def test_a_process_that_ended_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = psutil.Process(child.pid).create_time()
    child.wait()
    assert same_process(child.pid, start) is False
