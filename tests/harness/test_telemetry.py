"""The level telemetry sampler on this machine's real host readings (NVML absent: GPU part off) and, marked gpu, on a
real NVML device while torch keeps it busy. Needs no root conftest: on a GPU host without MLflow run it with
`python3 -m pytest --noconftest -m gpu -o addopts= tests/harness/test_telemetry.py`."""
from __future__ import annotations

import csv
import io
import json
import time

import psutil
import pytest

from experiments.harness.telemetry import ENERGY_COUNTER, TABLE, WINDOWS, LevelTelemetry, NvmlGpus


def _busy_cpu(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))


def test_without_nvml_gpu_telemetry_is_off_and_the_host_is_sampled_inside_each_level_only() -> None:
    gpus, _ = NvmlGpus.open()
    if gpus is not None:
        gpus.close()
        pytest.skip("this machine has a GPU: the off path is not reachable")
    telemetry = LevelTelemetry.open(interval_s=0.1)
    assert telemetry.status.startswith("off: ")
    psutil.cpu_percent(interval=None)
    telemetry.start(1, 0)
    _busy_cpu(1.0)
    telemetry.stop()
    whole_window = psutil.cpu_percent(interval=None)   # psutil's own reading over the same second
    time.sleep(0.5)   # between levels (a warm-up): not sampled
    telemetry.start(2, 0)
    time.sleep(0.6)
    telemetry.stop()
    telemetry.close()
    rows = list(csv.DictReader(io.StringIO(telemetry.artifacts()[TABLE])))
    windows = json.loads(telemetry.artifacts()[WINDOWS])["windows"]
    assert {r["device"] for r in rows} == {"host"}
    gap = (windows[0]["end_s"], windows[1]["start_s"])
    assert gap[1] - gap[0] >= 0.45 and not [r for r in rows if gap[0] + 0.001 < float(r["t_s"]) < gap[1] - 0.001]
    per_level = telemetry.level_metrics({1: 10.0, 2: 10.0})
    # other jobs share this host: the level's mean is checked against psutil, not against an expected load
    assert per_level[1]["host_cpu_util_pct_mean"] == pytest.approx(whole_window, abs=10.0)
    assert per_level[1]["host_cpu_util_pct_mean"] >= 100.0 / (psutil.cpu_count() or 1) * 0.8   # this loop's core
    assert all(per_level[c]["telemetry_samples"] >= 4 for c in (1, 2))
    assert not any(k.startswith(("gpu_", "energy")) for m in per_level.values() for k in m)


@pytest.mark.gpu
def test_on_a_real_gpu_power_utilisation_and_energy_per_token_follow_the_work() -> None:
    gpus, status = NvmlGpus.open()
    if gpus is None:
        pytest.skip(f"needs an NVML GPU ({status})")
    gpus.close()
    torch = pytest.importorskip("torch")
    telemetry = LevelTelemetry.open()
    assert telemetry.status.startswith("on: NVML")
    telemetry.start(1, 0)
    time.sleep(1.5)   # idle
    telemetry.stop()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    telemetry.start(8, 0)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    telemetry.stop()
    telemetry.close()
    per_level = telemetry.level_metrics({1: 100.0, 8: 100.0})
    idle, busy = per_level[1], per_level[8]
    assert busy["gpu_util_pct_mean"] > 50 > idle["gpu_util_pct_mean"]
    assert busy["gpu_power_w_mean"] > idle["gpu_power_w_mean"] > 0
    assert busy["energy_per_token_j"] == pytest.approx(busy["gpu_energy_j"] / 100.0)
    assert busy["gpu_sm_clock_mhz_mean"] > 0 and 10 < busy["gpu_temp_c_max"] < 110
    assert busy["gpu_mem_used_mib_max"] > idle["gpu_mem_used_mib_max"]
    assert busy["telemetry_samples"] >= 3.0 / 0.25 * 0.8
    window = telemetry.windows[1]
    for device in telemetry.gpu_devices:   # the energy counter, and the power samples agreeing with it
        energy, source = window.energy_j(device)
        assert source == ENERGY_COUNTER and energy > 0
        power = [(t, v) for t, _, d, m, v in window.samples if d == device and m == "power_w"]
        trapezoid = sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in zip(power, power[1:], strict=False))
        assert trapezoid == pytest.approx(energy, rel=0.5)
