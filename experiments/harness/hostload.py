"""How loaded the host was around a measured level, by processes other than this runner's own tree (the runner
and its descendants, the engine server included): a measurement taken while another runner shared the cores is
slower for that reason alone (two baselines stored at 1.88 and 2.50 tok/s against ~3.5 alone).

CPU: the system's busy time (psutil.cpu_times(): all fields but idle and iowait; guest time is already in user
and nice on Linux, so it is left out once; steal stays in, another tenant's use of this VM's cores) minus the CPU
time of the runner's tree. The tree's time is, per live process, user + system + children_user + children_system:
a process's own time stops growing when it exits, and once its parent reaps it, it moves into the parent's
children_* -- a live process is never in anyone's children_*, so nothing is counted twice, and a descendant that
ends inside the window is still counted as the runner's. Lost: a descendant that is never reaped, or whose parent
exits first (it is no longer in the tree); its time then counts as other."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil

NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HostLoad:
    """One window: wall seconds, CPU seconds of the runner's tree and of the rest, load average at both ends."""
    wall_s: float
    own_cpu_s: float
    other_cpu_s: float
    load1_start: float
    load1_end: float
    cpus: int                             # logical CPUs of the machine (those psutil.cpu_times() covers)
    other_gpu_procs: int | None = None    # compute processes on the GPUs outside the tree; None: no nvidia-smi

    @property
    def other_cores_busy(self) -> float:
        """Cores kept busy by other processes on average (CPU-tick noise can make the difference slightly < 0)."""
        return max(0.0, self.other_cpu_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def own_cores_busy(self) -> float:
        return self.own_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """The per-level summary entries (`host_*`)."""
        out = {"host_load1_start": self.load1_start, "host_load1_end": self.load1_end,
               "host_other_cores_busy": self.other_cores_busy}
        if self.other_gpu_procs is not None:
            out["host_other_gpu_procs"] = float(self.other_gpu_procs)
        return out


@dataclass(frozen=True)
class _Sample:
    t: float
    load1: float
    busy_s: float
    tree_s: float
    tree_pids: frozenset[int]
    gpu_pids: frozenset[int] | None


class HostSampler:
    """Samples the host at `start()` and at `stop()`; the window's HostLoad comes from the two."""

    def __init__(self, root: psutil.Process | None = None, served_by: Iterable[psutil.Process] = ()):
        """`served_by`: the processes of a server on this host that the runner did not start (`server.url`):
        their trees count as the measurement's own, not as other load."""
        self.root = root or psutil.Process()
        self.served_by = list(served_by)
        self._first: _Sample | None = None

    @classmethod
    def start(cls, root: psutil.Process | None = None, served_by: Iterable[psutil.Process] = ()) -> HostSampler:
        sampler = cls(root, served_by)
        sampler._first = sampler._sample()
        return sampler

    def stop(self) -> HostLoad:
        if self._first is None:
            raise RuntimeError("HostSampler.stop() before start()")
        a, b = self._first, self._sample()
        own = b.tree_s - a.tree_s
        return HostLoad(wall_s=b.t - a.t, own_cpu_s=own, other_cpu_s=(b.busy_s - a.busy_s) - own,
                        load1_start=a.load1, load1_end=b.load1, cpus=os.cpu_count() or 1,
                        other_gpu_procs=_other_gpu_procs(a, b))

    def _sample(self) -> _Sample:
        tree_s, pids = tree_cpu_s(self.root)
        for server in self.served_by:
            server_s, server_pids = tree_cpu_s(server, exclude=pids)
            tree_s, pids = tree_s + server_s, pids | server_pids
        return _Sample(time.monotonic(), os.getloadavg()[0], busy_cpu_s(), tree_s, frozenset(pids), gpu_pids())


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy since boot (psutil's own reading of busy time)."""
    t = psutil.cpu_times()
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - t.idle - getattr(t, "iowait", 0.0)


def tree_cpu_s(root: psutil.Process, exclude: Iterable[int] = ()) -> tuple[float, set[int]]:
    """CPU seconds of `root` and its live descendants, with the reaped children of each; and their pids
    (those in `exclude` left out: already counted)."""
    total, pids, skip = 0.0, set(), set(exclude)
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, set()
    for p in procs:
        if p.pid in skip:
            continue
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):   # gone since the listing: in its parent's children_*
            continue
        total += t.user + t.system + t.children_user + t.children_system
        pids.add(p.pid)
    return total, pids


def gpu_pids() -> frozenset[int] | None:
    """Pids of the compute processes on the GPUs (nvidia-smi); None where there is no nvidia-smi or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(out.stdout) if out.returncode == 0 else None


def parse_compute_apps(text: str) -> frozenset[int]:
    """Pids of `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader` (one row per process and
    GPU: a process on two GPUs is one pid)."""
    pids = (line.split(",", 1)[0].strip() for line in text.splitlines())
    return frozenset(int(p) for p in pids if p.isdigit())


def _other_gpu_procs(a: _Sample, b: _Sample) -> int | None:
    """The larger count of the two ends: GPU processes outside the tree (its pids at either end)."""
    if a.gpu_pids is None or b.gpu_pids is None:
        return None
    own = a.tree_pids | b.tree_pids
    return max(len(a.gpu_pids - own), len(b.gpu_pids - own))


def combine(loads: Iterable[HostLoad]) -> HostLoad | None:
    """The windows of one level's repetitions, measured back to back, as one: times added, load average from
    the first one's start to the last one's end, the most GPU processes seen."""
    loads = list(loads)
    if not loads:
        return None
    gpu = [x.other_gpu_procs for x in loads if x.other_gpu_procs is not None]
    return HostLoad(wall_s=sum(x.wall_s for x in loads), own_cpu_s=sum(x.own_cpu_s for x in loads),
                    other_cpu_s=sum(x.other_cpu_s for x in loads), load1_start=loads[0].load1_start,
                    load1_end=loads[-1].load1_end, cpus=loads[0].cpus, other_gpu_procs=max(gpu) if gpu else None)


def host_loaded(values: Mapping, cpu_count: int, threshold_share: float = 0.25) -> bool:
    """Whether other processes kept more than `threshold_share` of `cpu_count` cores busy in any level. `values`:
    a summary's per_level ({concurrency: {"host_other_cores_busy": ...}}) or a run's metrics
    (host_other_cores_busy_c<c>, host_other_cores_busy_max). A run without these numbers is not taken as loaded."""
    return any(busy > threshold_share * cpu_count for busy in _other_busy(values))


def _other_busy(values: Mapping) -> list[float]:
    if all(isinstance(v, Mapping) for v in values.values()):
        return [float(m["host_other_cores_busy"]) for m in values.values() if "host_other_cores_busy" in m]
    return [float(v) for k, v in values.items() if str(k).startswith("host_other_cores_busy")]
