"""The all-reduce benchmark: nccl-tests' bandwidth definitions, Kimi's sizes, a real 2-rank gloo run on the CPU."""
from __future__ import annotations

import json

import pytest

from experiments.box.allreduce_bench import KIMI_HIDDEN, MIB, bus_bandwidth, kimi_sizes, main, run


def test_bus_bandwidth_is_nccl_tests_factor() -> None:
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert bus_bandwidth(10.0, 2) == pytest.approx(10.0)


def test_sizes_start_at_one_kimi_token_and_end_at_the_cap() -> None:
    sizes = kimi_sizes()
    assert sizes[0] == KIMI_HIDDEN * 2 and KIMI_HIDDEN * 2 * 512 in sizes
    assert sizes[-1] == 256 * MIB and sizes == sorted(set(sizes))


def test_two_gloo_ranks_measure_and_record_the_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    out = tmp_path / "ar.json"
    result = run(2, str(out), backend="gloo", sizes=[KIMI_HIDDEN * 2, KIMI_HIDDEN * 2 * 4], warmup=1, iters=3)
    assert json.loads(out.read_text()) == result
    assert result["ranks"] == 2 and result["env"]["NCCL_P2P_DISABLE"] == "1"
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert r["time_us"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])   # n = 2: factor 1


def test_cli_prints_and_writes(tmp_path, capsys) -> None:
    out = tmp_path / "cli.json"
    assert main(["--gpus", "2", "--backend", "gloo", "--max-mib", "1", "--warmup", "0", "--iters", "1",
                 "--out", str(out)]) == 0
    assert "busbw" in capsys.readouterr().out and json.loads(out.read_text())["rows"]
