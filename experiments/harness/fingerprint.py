"""The host a run measured on, as data (`host.json`) and compact tags (`host.*`): the CPU (model, cores, clock,
kernel, whether it is a VM), the GPUs through NVML (name, driver, CUDA version, SM / memory clocks now and at
most, power limit, performance state, clock-event reasons; off without a GPU, saying why), what the serving side
runs (experiments/harness/serving_env.py: the engine's resolved arguments and captured graph sizes, the head's
sha256, the serving interpreter's packages) and, per measured level, the load average, steal time and clock over
the level (`HostWindow`).

A run's record: `collect_host(...)` once the server is healthy, `HostWindow.start()` / `.stop()` around each level
(`HostRecord.window`), `HostRecord.to_dict()` into `Measurement.host`; the exporter writes it as `host.json` and
its `summary` as `host.<key>` tags."""
from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from experiments.harness.serving_env import engine_facts, head_digest, packages
from experiments.harness.telemetry import NvmlGpus

CPUINFO = Path("/proc/cpuinfo")
GOVERNOR = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")


def _cpuinfo() -> list[tuple[str, str]]:
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return []
    return [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines()) if v]


def cpu_mhz() -> float | None:
    """The mean of the cores' current clock (/proc/cpuinfo `cpu MHz`, else psutil); None where neither says."""
    mhz = [float(v) for k, v in _cpuinfo() if k == "cpu MHz"]
    if mhz:
        return sum(mhz) / len(mhz)
    freq = psutil.cpu_freq()
    return float(freq.current) if freq and freq.current else None


def cpu_facts() -> dict:
    """The CPU and the OS: model, logical / physical cores, clock (mean, min, max of the cores now; the rated
    maximum where the kernel says), governor, whether a hypervisor is below, NUMA nodes, memory, kernel."""
    info = _cpuinfo()
    first = {k: v for k, v in reversed(info)}
    mhz = [float(v) for k, v in info if k == "cpu MHz"]
    freq = psutil.cpu_freq()
    out = {"model": first.get("model name", platform.processor() or "unknown"),
           "logical_cores": psutil.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
           "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
           "mhz": sum(mhz) / len(mhz) if mhz else (freq.current if freq else None),
           "mhz_min_core": min(mhz) if mhz else None, "mhz_max_core": max(mhz) if mhz else None,
           "mhz_rated_max": freq.max if freq and freq.max else None,
           "virtualized": "hypervisor" in first.get("flags", "").split(),
           "governor": GOVERNOR.read_text().strip() if GOVERNOR.exists() else None,
           "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or None,
           "mem_total_gib": round(psutil.virtual_memory().total / 2 ** 30, 1),
           "kernel": platform.release(), "platform": platform.platform(), "hostname": platform.node()}
    return out


def gpu_facts(visible: str | None = None) -> dict:
    """The GPUs NVML sees (`visible`: CUDA_VISIBLE_DEVICES' names): driver, CUDA version, per GPU name, uuid, SM
    and memory clocks (now, at most), power limit, performance state, clock-event reasons. Without NVML or a GPU:
    `status` = `off: <why>` and nothing else."""
    gpus, status = NvmlGpus.open(visible)
    if gpus is None:
        return {"status": status}
    n = gpus.nvml
    try:
        cuda = n.nvmlSystemGetCudaDriverVersion()
        out = {"status": status, "driver": _text(n.nvmlSystemGetDriverVersion()),
               "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}", "gpus": {}}
        for device, h in gpus.devices.items():
            out["gpus"][device] = _one_gpu(gpus, h) | {"name": gpus.names[device]}
        return out
    finally:
        gpus.close()


def _one_gpu(gpus: NvmlGpus, h) -> dict:
    n, read = gpus.nvml, _number
    watts = lambda f: (lambda: f(h) / 1000.0)
    return {"uuid": _safe(lambda: _text(n.nvmlDeviceGetUUID(h))),
            "sm_clock_mhz": read(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            "mem_clock_mhz": read(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
            "sm_clock_max_mhz": read(lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)),
            "mem_clock_max_mhz": read(lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM)),
            "power_limit_w": read(watts(n.nvmlDeviceGetPowerManagementLimit)),
            "power_limit_default_w": read(watts(n.nvmlDeviceGetPowerManagementDefaultLimit)),
            "pstate": read(lambda: n.nvmlDeviceGetPerformanceState(h)),
            "clock_event_reasons": read(lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h)),
            "mem_total_gib": read(lambda: n.nvmlDeviceGetMemoryInfo(h).total / 2 ** 30),
            "temp_c": read(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))}


def _safe(read) -> str | None:
    try:
        return read()
    except Exception:  # noqa: BLE001 - an NVMLError (not supported), or a call this pynvml lacks: left out
        return None


def _number(read) -> float | None:
    value = _safe(read)
    return None if value is None else float(value)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class HostWindow:
    """The host over one measured window: load average at both ends, the share of CPU time stolen by the
    hypervisor, spent in iowait and busy (from psutil.cpu_times() at both ends: no shared psutil state), and the
    cores' mean clock at both ends."""
    t: float
    times: object
    load1: float
    mhz: float | None

    @classmethod
    def start(cls) -> HostWindow:
        return cls(time.monotonic(), psutil.cpu_times(), os.getloadavg()[0], cpu_mhz())

    def stop(self) -> dict[str, float | None]:
        end, wall = psutil.cpu_times(), time.monotonic() - self.t
        delta = {k: getattr(end, k) - getattr(self.times, k) for k in end._fields}
        total = sum(v for k, v in delta.items() if k not in ("guest", "guest_nice")) or 1e-9
        busy = total - delta.get("idle", 0.0) - delta.get("iowait", 0.0)
        mhz = cpu_mhz()
        return {"wall_s": wall, "load1_start": self.load1, "load1_end": os.getloadavg()[0],
                "steal_pct": 100.0 * delta.get("steal", 0.0) / total,
                "iowait_pct": 100.0 * delta.get("iowait", 0.0) / total, "busy_pct": 100.0 * busy / total,
                "mhz_start": self.mhz, "mhz_end": mhz}


@dataclass
class HostRecord:
    """One run's host record: the facts collected once, the windows per level (and block)."""
    facts: dict
    windows: dict[str, dict] = field(default_factory=dict)
    _open: dict[str, HostWindow] = field(default_factory=dict)

    def start(self, level: int, block: int | str = 0) -> None:
        self._open[f"c{level}/{block}"] = HostWindow.start()

    def stop(self, level: int, block: int | str = 0) -> dict:
        key = f"c{level}/{block}"
        self.windows[key] = self._open.pop(key).stop()
        return self.windows[key]

    def metrics(self) -> dict[str, float]:
        """Per level: `host_steal_pct_c<c>` (the level's windows' mean), `host_cpu_mhz_c<c>` (mean of the ends)."""
        out: dict[str, float] = {}
        for level in sorted({k.split("/")[0] for k in self.windows}):
            ws = [w for k, w in self.windows.items() if k.split("/")[0] == level]
            out[f"host_steal_pct_{level}"] = sum(w["steal_pct"] for w in ws) / len(ws)
            mhz = [m for w in ws for m in (w["mhz_start"], w["mhz_end"]) if m is not None]
            if mhz:
                out[f"host_cpu_mhz_{level}"] = sum(mhz) / len(mhz)
        return out

    def to_dict(self) -> dict:
        return {**self.facts, "windows": self.windows, "summary": host_summary(self.facts)}


def collect_host(engine: str, url: str | None = None, log_path: Path | str | None = None,
                 python: str | None = None, env: dict[str, str] | None = None, head: str | Path | None = None,
                 visible: str | None = None) -> HostRecord:
    """Everything recorded once per run, after the server is healthy (its graphs are captured by then)."""
    facts = {"recorded_unix": time.time(), "cpu": cpu_facts(), "gpu": gpu_facts(visible),
             "engine": engine_facts(engine, url, log_path), "head": head_digest(head),
             "packages": packages(python, env) if python else None}
    return HostRecord(facts)


def host_summary(facts: dict) -> dict[str, str]:
    """The compact tags (`host.<key>` on the run): what tells two hosts and two serving setups apart."""
    cpu, gpu = facts.get("cpu") or {}, facts.get("gpu") or {}
    first = next(iter((gpu.get("gpus") or {}).values()), {})
    pkgs, head, engine = facts.get("packages") or {}, facts.get("head") or {}, facts.get("engine") or {}
    out = {"cpu_model": cpu.get("model"), "cpu_cores": f"{cpu.get('logical_cores')}/{cpu.get('physical_cores')}",
           "cpu_mhz": _fmt(cpu.get("mhz")), "kernel": cpu.get("kernel"), "virtualized": cpu.get("virtualized"),
           "gpu": first.get("name") or gpu.get("status"), "gpu_count": len(gpu.get("gpus") or {}) or None,
           "gpu_driver": gpu.get("driver"), "cuda": gpu.get("cuda"),
           "gpu_sm_clock_max_mhz": _fmt(first.get("sm_clock_max_mhz")),
           "gpu_power_limit_w": _fmt(first.get("power_limit_w")),
           "engine_args_sha256": (engine.get("args_sha256") or "")[:16] or None,
           "cuda_graph_bs": graph_summary(engine.get("graphs") or {}) or None,
           "head_sha256": (head.get("sha256") or "")[:16] or None,
           "packages_sha256": (pkgs.get("sha256") or "")[:16] or None, "packages_count": pkgs.get("count"),
           **{f"pkg.{k}": v for k, v in (pkgs.get("key") or {}).items()}}
    return {k: str(v) for k, v in out.items() if v is not None}


def graph_summary(graphs: dict[str, dict]) -> str:
    """`target verify=1..32(20); draft decode=1..32(20)`: each graph's batch sizes, smallest..largest (count)."""
    parts = []
    for name, g in sorted(graphs.items()):
        sizes = g.get("bs") or g.get("num_tokens") or []
        parts.append(f"{name}={min(sizes)}..{max(sizes)}({len(sizes)})" if sizes else f"{name}=none")
    return "; ".join(parts)


def _fmt(value: float | None) -> str | None:
    return None if value is None else re.sub(r"\.0$", "", f"{float(value):.1f}")
