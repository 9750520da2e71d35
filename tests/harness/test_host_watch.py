"""experiments/harness/host_watch.py: around a slice of a running server's work (a real busy process, found by its
start time as a server of `server.url` is), the host's window and the engine's CPU time are recorded under the
slice's key, the slice's output tokens give CPU time per token, and with no serving interpreter the probe is off and
says so."""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from experiments.engines.served import Served
from experiments.harness.attached import AttachedServer
from experiments.harness.host_watch import HostWatch
from experiments.harness.telemetry import LevelTelemetry


@pytest.fixture
def watched(tmp_path: Path, monkeypatch) -> Iterator[tuple[HostWatch, int]]:
    monkeypatch.setenv("SPECWS_CACHE", str(tmp_path))
    engine = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    start = psutil.Process(engine.pid).create_time()
    server = AttachedServer(Served("http://127.0.0.1:9", "vllm", "0.32", instance="x", start_time=start), "/health")
    watch = HostWatch.open(LevelTelemetry.open(), server, "vllm", None, None, "cpu", None, None, None)
    yield watch, engine.pid
    watch.close()
    engine.kill()
    engine.wait()


def _slice(watch: HostWatch, level: int, rep: int) -> None:
    watch.start(level, rep)
    time.sleep(0.4)
    watch.stop()


def test_a_slice_records_the_host_window_and_the_engines_cpu_time(watched) -> None:
    watch, pid = watched
    _slice(watch, 4, 0)
    host, calibration = watch.close()
    assert list(host["windows"]) == ["c4/0"] and host["windows"]["c4/0"]["wall_s"] >= 0.4
    engine = calibration["engine_cpu"]["c4/0"]
    assert engine["cpu_s"] > 0 and f"python[{pid}]" in engine["per_process_s"]


def test_output_tokens_give_cpu_time_per_token_of_known_slices_only(watched) -> None:
    watch, _ = watched
    _slice(watch, 4, 0)
    watch.output_tokens({(4, 0): 100.0, (8, 0): 5.0})
    metrics = watch.metrics()
    cpu_s = metrics["host_engine_cpu_s_c4"]
    assert metrics["host_engine_cpu_ms_per_tok_c4"] == pytest.approx(cpu_s * 1000 / 100)
    assert "host_steal_pct_c4" in metrics and not any(k.endswith("_c8") for k in metrics)


def test_without_a_serving_interpreter_the_probe_is_off(watched) -> None:
    watch, _ = watched
    _slice(watch, 1, 0)
    assert watch.tags()["host.calibration"] == "off: no serving interpreter to probe in"
    assert watch.changed() == {}
    assert watch.close()[1]["samples"] == []


def test_stop_without_a_slice_records_nothing(watched) -> None:
    watch, _ = watched
    watch.stop()
    host, calibration = watch.close()
    assert host["windows"] == {} and calibration["engine_cpu"] == {}
