"""Decode-time shares from a synthetic chrome trace whose kernel names are real NCCL / sgl-kernel / SGLang ones."""
from __future__ import annotations

import gzip
import json

import pytest

from experiments.analysis.speedup.model import BoxProfile
from experiments.box.decode_profile import box_shares, classify, main, profile

KERNELS = {   # name -> (class, microseconds)
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": ("allreduce", 500.0),
    "_fwd_grouped_kernel_stage1": ("attention", 100.0),
    "_fwd_kernel_stage2": ("attention", 50.0),
    "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": ("dense", 120.0),
    "void marlin_moe_wna16::Marlin<256, 1, 8, 8, 4, 8>(MarlinParams)": ("moe", 90.0),
    "fused_moe_kernel_gptq_awq": ("moe", 10.0),
    "moe_align_block_size_kernel": ("moe", 5.0),
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": ("other", 125.0),
}


def synthetic_trace() -> dict:
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": i * 1000, "dur": us, "pid": 0, "tid": 7}
              for i, (n, (_, us)) in enumerate(KERNELS.items())]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9999.0, "pid": 1, "tid": 1},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 77.0},
               {"ph": "i", "cat": "kernel", "name": "ncclDevKernel_marker", "ts": 0}]
    return {"schemaVersion": 1, "traceEvents": events}


@pytest.mark.parametrize("name, expected", [(n, c) for n, (c, _) in KERNELS.items()])
def test_real_kernel_names_are_classified(name: str, expected: str) -> None:
    assert classify(name) == expected


def test_shares_count_only_gpu_kernels(tmp_path) -> None:
    path = tmp_path / "1700000000-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(synthetic_trace(), f)
    result = profile([path])
    assert result["kernel_time_us"] == pytest.approx(1000.0)
    assert result["shares"] == pytest.approx({"allreduce": 0.5, "attention": 0.15, "dense": 0.12,
                                              "moe": 0.105, "other": 0.125})
    assert next(iter(result["top_kernels"]["moe"])).startswith("void marlin_moe_wna16")


def test_box_seed_profile_is_alongside(tmp_path, capsys) -> None:
    assert box_shares()["allreduce"] == pytest.approx(0.515)
    assert box_shares()["other"] == pytest.approx(0.087)          # 1 - 0.515 - 0.153 - 0.134 - 0.111
    assert box_shares(BoxProfile(share_moe=0.5))["other"] == 0.0   # shares past 1 leave no negative remainder
    path = tmp_path / "t.json"
    path.write_text(json.dumps(synthetic_trace()))
    main([str(path), "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "| allreduce | 50.0% | 51.5% |" in out
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["shares"]["moe"] == pytest.approx(0.105)        # (90 + 10 + 5) of the trace's 1000 us
    assert written["box_shares"]["moe"] == pytest.approx(0.111)
