"""Telemetry of the measured levels: per GPU through NVML (utilisation, memory used, power, SM clock,
temperature, the board's energy counter) and the host's CPU utilisation and memory through psutil, sampled every
`SAMPLE_INTERVAL_S` in a background thread from a level's start to its end only (no warm-up, no server start).

Energy of a level comes from NVML's total-energy counter (millijoules since the driver loaded; Volta and later),
read at both ends of each slice; where a GPU has no counter, from the trapezoid of its power samples. Without
NVML (not installed, no driver, no GPU) the GPU part is off and `status` says why; the host part always runs.

A run keeps the samples as one long table (`TABLE`: one row per sample, device and metric) and the windows as
`WINDOWS`; experiments.tracking.export writes them, experiments.analysis.report plots them."""
from __future__ import annotations

import csv
import io
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from experiments.harness.hostload import busy_cpu_s

SAMPLE_INTERVAL_S = 0.25
TABLE = "telemetry/samples.csv"
WINDOWS = "telemetry/windows.json"
COLUMNS = ("t_s", "time_unix_ms", "concurrency", "repetition", "device", "metric", "value")
TAG = "telemetry.gpu"
HOST = "host"
ENERGY_COUNTER, POWER_TRAPEZOID = "nvml_energy_counter", "power_trapezoid"


@dataclass
class Window:
    """One measured (level, repetition) slice: its bounds on the monotonic clock, its samples and, per GPU, the
    energy counter at both ends (None where the GPU has none)."""
    concurrency: int
    repetition: int
    start: float
    end: float | None = None
    samples: list[tuple[float, int, str, str, float]] = field(default_factory=list)  # t, unix ms, device, metric, v
    counter_start: dict[str, float | None] = field(default_factory=dict)
    counter_end: dict[str, float | None] = field(default_factory=dict)
    busy_cpu: tuple[float, float | None] | None = None   # the machine's busy CPU seconds at both ends

    def energy_j(self, device: str) -> tuple[float | None, str]:
        """The GPU's energy over the window in joules and where it came from (counter, else power trapezoid)."""
        a, b = self.counter_start.get(device), self.counter_end.get(device)
        if a is not None and b is not None and b >= a:
            return (b - a) / 1000.0, ENERGY_COUNTER
        power = [(t, v) for t, _, d, m, v in self.samples if d == device and m == "power_w"]
        if len(power) < 2:
            return None, POWER_TRAPEZOID
        pairs = zip(power, power[1:], strict=False)
        return sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in pairs), POWER_TRAPEZOID


class NvmlGpus:
    """The GPUs NVML sees (or those `visible` names: CUDA_VISIBLE_DEVICES indices or UUIDs), read per sample."""

    def __init__(self, nvml: Any, devices: dict[str, Any], names: dict[str, str]) -> None:
        self.nvml, self.devices, self.names = nvml, devices, names

    @classmethod
    def open(cls, visible: str | None = None) -> tuple[NvmlGpus | None, str]:
        """The GPUs and a status line: `on: ...`, or `off: <reason>` with None."""
        try:
            import pynvml as nvml
        except ImportError:
            return None, "off: pynvml (nvidia-ml-py) is not installed"
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return None, f"off: NVML did not start ({exc})"
        try:
            handles = _handles(nvml, visible)
        except nvml.NVMLError as exc:
            nvml.nvmlShutdown()
            return None, f"off: NVML could not list the GPUs ({exc})"
        if not handles:
            nvml.nvmlShutdown()
            return None, "off: NVML sees no GPU"
        names = {d: _text(nvml.nvmlDeviceGetName(h)) for d, h in handles.items()}
        gpus = cls(nvml, handles, names)
        counters = "energy counter" if all(v is not None for v in gpus.energy_mj().values()) else "power trapezoid"
        shown = ", ".join(f"{d} {n}" for d, n in names.items())
        return gpus, f"on: NVML, {len(handles)} GPU ({shown}), every {SAMPLE_INTERVAL_S} s, energy by {counters}"

    def read(self) -> list[tuple[str, str, float]]:
        """(device, metric, value) of every reading this GPU supports now."""
        out = []
        for device, h in self.devices.items():
            for metric, value in self._readings(h):
                if value is not None:
                    out.append((device, metric, float(value)))
        return out

    def _readings(self, h: Any) -> list[tuple[str, float | None]]:
        n = self.nvml
        return [("util_pct", self._try(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu)),
                ("mem_used_mib", self._try(lambda: n.nvmlDeviceGetMemoryInfo(h).used / 2 ** 20)),
                ("power_w", self._try(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0)),
                ("sm_clock_mhz", self._try(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
                ("temp_c", self._try(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)))]

    def energy_mj(self) -> dict[str, float | None]:
        """Each GPU's total-energy counter in millijoules, None where it has none."""
        return {d: self._try(lambda h=h: self.nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                for d, h in self.devices.items()}

    def _try(self, read) -> float | None:
        try:
            return float(read())
        except self.nvml.NVMLError:   # not supported on this board, or a transient driver error
            return None

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _handles(nvml: Any, visible: str | None) -> dict[str, Any]:
    names = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not names:
        return {f"gpu{i}": nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())}
    out = {}
    for name in names:
        h = nvml.nvmlDeviceGetHandleByIndex(int(name)) if name.isdigit() else nvml.nvmlDeviceGetHandleByUUID(name)
        out[f"gpu{nvml.nvmlDeviceGetIndex(h)}"] = h
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class HostReadings:
    """The host's CPU utilisation since the previous reading (busy CPU time over the wall time of all CPUs, as
    experiments.harness.hostload reads it: no shared psutil state) and its memory in use."""

    def __init__(self) -> None:
        self._last = (time.monotonic(), busy_cpu_s())

    def read(self) -> list[tuple[str, str, float]]:
        (t0, busy0), now = self._last, (time.monotonic(), busy_cpu_s())
        self._last = now
        out = [(HOST, "mem_used_mib", psutil.virtual_memory().used / 2 ** 20)]
        if now[0] > t0:
            share = (now[1] - busy0) / ((now[0] - t0) * (psutil.cpu_count() or 1))
            out.append((HOST, "cpu_util_pct", 100.0 * min(1.0, max(0.0, share))))
        return out


class LevelTelemetry:
    """Samples while a level runs: `start(level, rep)` ... `stop()` per slice; `close()` on every way out."""

    def __init__(self, gpus: NvmlGpus | None, status: str, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.gpus, self.status, self.interval_s = gpus, status, interval_s
        self.windows: list[Window] = []
        self.origin: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.host = HostReadings()

    @classmethod
    def open(cls, visible: str | None = None, interval_s: float = SAMPLE_INTERVAL_S) -> LevelTelemetry:
        gpus, status = NvmlGpus.open(visible)
        return cls(gpus, status, interval_s)

    @property
    def gpu_devices(self) -> list[str]:
        return list(self.gpus.devices) if self.gpus is not None else []

    def start(self, concurrency: int, repetition: int) -> None:
        if self._thread is not None:
            self.stop()
        now = time.monotonic()
        self.origin = now if self.origin is None else self.origin
        window = Window(concurrency, repetition, now, counter_start=self._counters(), busy_cpu=(busy_cpu_s(), None))
        self.windows.append(window)
        self.host = HostReadings()   # CPU utilisation from the window's start, not from the last window
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample_until_stopped, args=(window,), daemon=True,
                                        name="level-telemetry")
        self._thread.start()

    def stop(self) -> None:
        """End the running window with one last sample (none running: nothing to do)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        window = self.windows[-1]
        self._sample(window)
        window.counter_end, window.end = self._counters(), time.monotonic()
        window.busy_cpu = (window.busy_cpu[0], busy_cpu_s()) if window.busy_cpu else None

    def close(self) -> None:
        self.stop()
        if self.gpus is not None and not self._closed:
            self.gpus.close()
        self._closed = True

    def _sample_until_stopped(self, window: Window) -> None:
        self._sample(window, host=False)   # at the start: no CPU interval to read yet
        while not self._stop.wait(self.interval_s):
            self._sample(window)

    def _sample(self, window: Window, host: bool = True) -> None:
        t, unix_ms = time.monotonic(), int(time.time() * 1000)
        readings = (self.gpus.read() if self.gpus is not None else []) + (self.host.read() if host else [])
        window.samples.extend((t, unix_ms, d, m, v) for d, m, v in readings)

    def _counters(self) -> dict[str, float | None]:
        return self.gpus.energy_mj() if self.gpus is not None else {}

    def level_metrics(self, output_tokens: dict[int, float]) -> dict[int, dict[str, float]]:
        """Per concurrency (its repetitions together): energy per output token beside GPU power, utilisation,
        memory, clock and temperature, and the host's CPU utilisation. `output_tokens`: the level's tokens.
        Energy and mean power are of all sampled GPUs together; utilisation, clock are means over GPUs and samples,
        the maxima over both."""
        out: dict[int, dict[str, float]] = {}
        for c in sorted({w.concurrency for w in self.windows}):
            ws = [w for w in self.windows if w.concurrency == c and w.end is not None]
            if ws:
                out[c] = _level(ws, self.gpu_devices, output_tokens.get(c, 0.0))
        return out

    def table(self) -> str:
        """The samples as CSV (COLUMNS), time from the first window's start."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(COLUMNS)
        for w in self.windows:
            for t, unix_ms, device, metric, value in w.samples:
                writer.writerow((f"{t - (self.origin or t):.3f}", unix_ms, w.concurrency, w.repetition, device,
                                 metric, f"{value:.6g}"))
        return buf.getvalue()

    def artifacts(self) -> dict[str, str]:
        """Artifact name -> text: the samples table and the windows."""
        return {TABLE: self.table(), WINDOWS: json.dumps(self.describe(), indent=1)}

    def describe(self) -> dict:
        """The devices and windows (bounds, energy and its source per GPU), for WINDOWS."""
        names = self.gpus.names if self.gpus is not None else {}
        return {"status": self.status, "interval_s": self.interval_s, "gpus": names,
                "windows": [{"concurrency": w.concurrency, "repetition": w.repetition,
                             "start_s": w.start - (self.origin or w.start),
                             "end_s": None if w.end is None else w.end - (self.origin or w.start),
                             "energy_j": {d: w.energy_j(d)[0] for d in names},
                             "energy_source": {d: w.energy_j(d)[1] for d in names}} for w in self.windows]}


def _level(ws: list[Window], gpus: list[str], tokens: float) -> dict[str, float]:
    def values(device_kind: str, metric: str) -> list[float]:
        return [v for w in ws for _, _, d, m, v in w.samples
                if m == metric and (d == HOST if device_kind == HOST else d != HOST)]

    wall = sum(w.end - w.start for w in ws)
    m: dict[str, float] = {"telemetry_samples": float(sum(len({s[0] for s in w.samples}) for w in ws))}
    busy = [(w.busy_cpu[1] - w.busy_cpu[0], w.end - w.start) for w in ws if w.busy_cpu and w.busy_cpu[1] is not None]
    if busy and sum(s for _, s in busy) > 0:
        # from the busy-CPU counter over the windows, not a mean of the samples: a sample's interval stretches when
        # the sampler waits for a busy CPU, and a single sample is clipped at 100 %
        share = sum(b for b, _ in busy) / (sum(s for _, s in busy) * (psutil.cpu_count() or 1))
        m["host_cpu_util_pct_mean"] = 100.0 * min(1.0, max(0.0, share))
    if not gpus:
        return m
    energies = [w.energy_j(d)[0] for w in ws for d in gpus]
    if all(e is not None for e in energies):
        energy = sum(energies)
        m["gpu_energy_j"] = energy
        m["gpu_power_w_mean"] = energy / wall if wall > 0 else 0.0
        if tokens > 0:
            m["energy_per_token_j"] = energy / tokens
    for metric, key, reduce in (("util_pct", "gpu_util_pct_mean", "mean"), ("power_w", "gpu_power_w_max", "max"),
                                ("mem_used_mib", "gpu_mem_used_mib_max", "max"),
                                ("sm_clock_mhz", "gpu_sm_clock_mhz_mean", "mean"), ("temp_c", "gpu_temp_c_max", "max")):
        vs = values("gpu", metric)
        if vs:
            m[key] = max(vs) if reduce == "max" else sum(vs) / len(vs)
    return m
