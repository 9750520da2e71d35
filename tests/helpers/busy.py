"""A busy process outside the caller's process tree: other load on the host, for the host-load cases."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

BUSY = "while True: pass"


@contextmanager
def busy_outsider() -> Iterator[int]:
    """A busy loop that is no descendant of this process: started by an intermediate process that exits at once,
    so the loop is handed to init (or a subreaper outside this tree). Its output goes nowhere: an inherited pipe
    would keep the intermediate's reader waiting. Yields its pid; killed on exit."""
    out = subprocess.run([sys.executable, "-c", "import subprocess, sys\n"
                          f"p = subprocess.Popen([sys.executable, '-c', {BUSY!r}], start_new_session=True, "
                          "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                          "print(p.pid)"], capture_output=True, text=True, timeout=30, check=True)
    pid = int(out.stdout)
    try:
        yield pid
    finally:
        kill(pid)


def kill(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass
