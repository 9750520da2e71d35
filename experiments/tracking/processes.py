"""Whether a process is still the one that was recorded: its pid exists with the same start time (a reused pid has
another). psutil only, so that the server watchdog can import it without loading the store."""
from __future__ import annotations

import psutil


def same_process(pid: int, start_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - start_time) < 1.0
    except psutil.Error:
        return False
