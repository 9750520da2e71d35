"""What of the INT4 MoE kernel microbenchmark runs on a CPU: its grid and arguments, the random layer and routing
at a tiny shape, the unpacking and the reference on the touched experts, the byte count, the JSON and table."""
from __future__ import annotations

import json

import pytest
import torch

from experiments.box import kimi_kernels as kk
from sglang_patches import selfcheck


def test_the_grid_is_kimis_shapes_and_quick_is_a_subset():
    full = kk.grid_for(quick=False, skew=0.25)
    assert full.ns == (2048, 256) and full.ms == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert full.routings == (("uniform", 0.0), ("skew0.25", 0.25)) and full.replays >= 20
    assert full.calls_for(1) == 8 and full.calls_for(63) == 8 and full.calls_for(64) == 2
    assert set(full.skewed_ms) < set(full.ms)
    quick = kk.grid_for(quick=True, skew=0.25)
    assert set(quick.ms) < set(full.ms) and quick.ns == full.ns and quick.routings == (("uniform", 0.0),)
    assert kk.grid_for(quick=False, skew=0.0).routings == (("uniform", 0.0),)
    assert (kk.EXPERTS, kk.TOP_K, kk.HIDDEN, kk.GROUP) == (384, 8, 7168, 32)


def test_arguments():
    args = kk.parse_args(["--out", "x.json"])
    assert args.kernels == ["triton_w4a16", "marlin_w4a16"] and args.budget_s == 90 and not args.quick
    args = kk.parse_args(["--out", "x.json", "--quick", "--kernels", "marlin_w4a16", "--skew", "0"])
    assert args.quick and args.kernels == ["marlin_w4a16"] and args.skew == 0
    with pytest.raises(SystemExit):
        kk.parse_args(["--out", "x.json", "--kernels", "cutlass"])


def test_random_layer_is_the_loaded_compressed_tensors_layout():
    shape, n = kk.TINY, 128
    layer = kk.random_layer(shape, n, "cpu", seed=1)
    assert layer.w13.dtype == torch.int32 and layer.w13.shape == (16, 256 // 8, 2 * n)
    assert layer.w2.shape == (16, n // 8, 256) and layer.shape == (16, 256, n)
    assert layer.s13.shape == (16, 2 * n, 256 // 32) and layer.s2.shape == (16, 256, n // 32)
    assert layer.s13.dtype == torch.bfloat16 and 0.0099 <= float(layer.s2.min()) and float(layer.s2.max()) <= 0.0302
    q = kk.unpack_int32_along_k(layer.w13)
    assert q.shape == (16, 2 * n, 256) and set(q.unique().tolist()) == set(range(-8, 8))
    assert torch.equal(selfcheck.pack_int32_along_k(q), layer.w13)
    again = kk.random_layer(shape, n, "cpu", seed=1)
    assert torch.equal(again.w2, layer.w2) and torch.equal(again.s13, layer.s13)


def test_triton_layout_holds_the_same_nibbles_low_first_along_k():
    layer = kk.random_layer(kk.TINY, 128, "cpu", seed=2)
    prepared = selfcheck.prepare_triton(layer)
    assert prepared.w13.dtype == torch.uint8 and prepared.w13.shape == (16, 256, 256 // 2)
    low, high = (prepared.w13 & 0xF).to(torch.int8) - 8, (prepared.w13 >> 4).to(torch.int8) - 8
    q = kk.unpack_int32_along_k(layer.w13)
    assert torch.equal(low, q[..., 0::2]) and torch.equal(high, q[..., 1::2])


def test_reference_on_the_touched_experts_equals_the_full_reference():
    shape, n = kk.TINY, 64
    layer = kk.random_layer(shape, n, "cpu", seed=3)
    batch = kk.random_batch(shape, 2, 0.0, seed=4, device="cpu")
    full = selfcheck.Problem(x=batch.x, logits=batch.logits, topk_weights=batch.topk_weights,
                             topk_ids=batch.topk_ids, q13=kk.unpack_int32_along_k(layer.w13), s13=layer.s13,
                             q2=kk.unpack_int32_along_k(layer.w2), s2=layer.s2, group_size=layer.group_size)
    sub = kk.reference_problem(layer, batch)
    assert sub.q13.shape[0] == kk.distinct_experts(batch) < shape.experts
    torch.testing.assert_close(selfcheck.reference(sub), selfcheck.reference(full))
    torch.testing.assert_close(kk.scaled_reference(layer, batch), selfcheck.reference(full) * 2.827)


def test_routing_uniform_and_skewed():
    shape = kk.Shape()
    uniform = kk.random_batch(shape, 64, 0.0, seed=0, device="cpu")
    assert uniform.topk_ids.shape == (64, 8) and uniform.topk_ids.dtype == torch.int32
    assert all(len(set(row.tolist())) == 8 for row in uniform.topk_ids)
    torch.testing.assert_close(uniform.topk_weights.sum(1), torch.ones(64))
    assert uniform.x.dtype == torch.bfloat16 and uniform.logits.shape == (64, 384)
    skewed = kk.random_batch(shape, 64, 0.5, seed=0, device="cpu")
    assert kk.distinct_experts(skewed) < 0.85 * kk.distinct_experts(uniform)
    assert 250 < kk.distinct_experts(uniform) < 320   # 384 (1 - (1 - 8/384)^64) = 284


def test_expert_bytes_add_up_to_a_kimi_layer():
    per_expert = kk.expert_bytes(kk.Shape(), 2048)
    assert per_expert == 3 * 2048 * 7168 // 2 + 2 * 3 * 2048 * 7168 // 32
    assert 9.0e9 < 384 * per_expert < 9.8e9   # "one MoE layer is about 9 GB in INT4"
    assert kk.expert_bytes(kk.Shape(), 256) * 8 == per_expert


def test_the_cli_on_a_cpu_writes_a_report_that_says_why_nothing_ran(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    out = tmp_path / "sub" / "kernels.json"
    assert kk.main(["--out", str(out), "--quick"]) == 0
    report = json.loads(out.read_text())
    assert "no CUDA device" in report["skipped"] and report["shape"]["experts"] == 384
    assert report["grid"]["ms"] == list(kk.QUICK_M) and not list(tmp_path.glob("sub/*.tmp"))
    assert "no CUDA device" in capsys.readouterr().out


def test_table_and_ratio():
    row = {"N": 2048, "M": 8, "routing": "uniform", "distinct_experts": 59.5,
           "marlin_w4a16": {"us": 100.0, "GBps": 1000.0}, "triton_w4a16": {"us": 150.0, "GBps": 666.7}}
    kk.add_ratio(row)
    assert row["triton_over_marlin"] == 1.5
    text = kk.table({"rows": {"a": row, "b": {"N": 256, "M": 1, "routing": "uniform",
                                              "triton_w4a16": {"error": "x"}}}})
    assert "1.50" in text and "nan" in text and len(text.splitlines()) == 3


def test_rows_past_the_deadline_are_listed_not_measured(tmp_path):
    grid = kk.grid_for(quick=False, skew=0.25)
    report = kk.Report(tmp_path / "r.json", {"rows": {}, "left_out": []})
    kk.measure_kernel("triton_w4a16", {2048: None, 256: None}, kk.Shape(), grid, report, deadline=0.0)
    written = json.loads((tmp_path / "r.json").read_text())
    assert len(written["left_out"]) == 2 * (len(grid.ms) + len(grid.skewed_ms))
    assert written["left_out"][0] == "triton_w4a16 N=2048 M=1 uniform"   # uniform at every N before skewed
    assert "triton_w4a16 N=256 M=512 skew0.25" in written["left_out"]
    assert "triton_w4a16 N=256 M=2 skew0.25" not in written["left_out"]


def test_a_build_past_its_timeout_is_ended_with_its_children():
    import subprocess
    import sys
    import time
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '60'])"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = time.perf_counter()
    result = kk.wait_prebuild(proc, started, timeout=1.0)
    assert result["status"] == "timeout" and time.perf_counter() - started < 10 and proc.poll() is not None
