"""INT4 (W4A16) MoE kernel self-check: run the installed SGLang's W4A16 MoE kernels on a small random
problem laid out the way SGLang lays out compressed-tensors INT4 weights, against a dequantised torch
reference, and refuse when a kernel disagrees.

The failure this catches: Kimi-K2.5 INT4 on Blackwell-class GPUs producing repeated-token garbage on the
Marlin WNA16 MoE path (sglang#23264) while the server starts and answers normally.

    python -m sglang_patches.selfcheck --json OUT.json      # every kernel that exists; exit 1 if one disagrees
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_TOLERANCE = 0.03   # relative L2 error; bf16 kernels land near 1e-2 or below, garbage near 1


@dataclass
class Problem:
    """One MoE layer with symmetric INT4 group-quantised experts (compressed-tensors pack-quantized)."""
    x: torch.Tensor             # [M, K] activations
    logits: torch.Tensor        # [M, E] router logits
    topk_weights: torch.Tensor  # [M, topk] float32
    topk_ids: torch.Tensor      # [M, topk] int32
    q13: torch.Tensor           # [E, 2N, K] int8 in [-8, 7]: gate rows then up rows
    s13: torch.Tensor           # [E, 2N, K // group] scales
    q2: torch.Tensor            # [E, K, N] int8
    s2: torch.Tensor            # [E, K, N // group]
    group_size: int


def make_problem(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, tokens: int = 32, hidden: int = 512,
                 intermediate: int = 256, experts: int = 8, topk: int = 2, group_size: int = 32,
                 seed: int = 0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    q13 = torch.randint(-8, 8, (experts, 2 * intermediate, hidden), generator=g, dtype=torch.int8)
    q2 = torch.randint(-8, 8, (experts, hidden, intermediate), generator=g, dtype=torch.int8)
    s13 = 0.01 + 0.02 * torch.rand(experts, 2 * intermediate, hidden // group_size, generator=g)
    s2 = 0.01 + 0.02 * torch.rand(experts, hidden, intermediate // group_size, generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return Problem(x=x.to(device, dtype), logits=logits.to(device, dtype), topk_weights=weights.to(device),
                   topk_ids=ids.to(device, torch.int32), q13=q13.to(device), s13=s13.to(device, dtype),
                   q2=q2.to(device), s2=s2.to(device, dtype), group_size=group_size)


def dequantise(q: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    return q.float() * s.float().repeat_interleave(group_size, dim=-1)


def reference(p: Problem, gate_offset: int = 0) -> torch.Tensor:
    """The MoE layer in float32 torch from dequantised weights (SiLU-gated, router-weighted sum)."""
    w13, w2 = dequantise(p.q13, p.s13, p.group_size), dequantise(p.q2, p.s2, p.group_size)
    n = w13.shape[1] // 2
    ids = p.topk_ids.long()
    h = torch.einsum("mk,mjnk->mjn", p.x.float(), w13[ids])                     # [M, topk, 2N]
    gate, up = (h[..., :n], h[..., n:]) if gate_offset == 0 else (h[..., n:], h[..., :n])
    y = torch.einsum("mjn,mjkn->mjk", F.silu(gate) * up, w2[ids])               # [M, topk, K]
    return (y * p.topk_weights[..., None].float()).sum(dim=1)


def pack_int32_along_k(q: torch.Tensor) -> torch.Tensor:
    """[E, rows, K] int4 values -> SGLang's loaded compressed-tensors layout [E, K // 8, rows] int32
    (unsigned nibble q + 8, eight along K per int32, lowest nibble first; transposed as SGLang loads it)."""
    u = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    packed = (u << shifts).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.transpose(1, 2).contiguous()


def _first(*candidates: str):
    """The first "module:name" that imports; raises ImportError listing what was tried."""
    errors = []
    for c in candidates:
        module, _, name = c.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{c}: {exc}")
    raise ImportError("; ".join(errors))


def ensure_global_server_args() -> None:
    """SGLang >= 0.5.14's MoE kernels read the scheduler's global ServerArgs, which a bare process lacks: set
    SGLang's own defaults (parsed, not post-initialised, so nothing is resolved or fetched)."""
    import argparse

    import sglang.srt.server_args as sa
    if not hasattr(sa, "set_global_server_args_for_scheduler"):
        return
    try:
        sa.get_global_server_args()
        return
    except ValueError:
        pass
    parser = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(parser)
    args = object.__new__(sa.ServerArgs)
    args.__dict__.update(vars(parser.parse_args(["--model-path", "selfcheck"])))
    sa.set_global_server_args_for_scheduler(args)


@dataclass
class PackedLayer:
    """One MoE layer's INT4 experts as SGLang holds them after loading a compressed-tensors checkpoint."""
    w13: torch.Tensor           # [E, K // 8, 2N] int32 (pack_int32_along_k of q13)
    w2: torch.Tensor            # [E, N // 8, K] int32
    s13: torch.Tensor           # [E, 2N, K // group] scales (Problem's layout)
    s2: torch.Tensor            # [E, K, N // group]
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts E, hidden K, intermediate N)."""
        return self.w13.shape[0], self.w2.shape[2], self.w13.shape[2] // 2


def packed_layer(p: Problem) -> PackedLayer:
    return PackedLayer(pack_int32_along_k(p.q13), pack_int32_along_k(p.q2), p.s13, p.s2, p.group_size)


@dataclass
class PreparedWeights:
    """A kernel's weights, converted once as its SGLang scheme does in process_weights_after_loading."""
    kernel: str
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor
    s2: torch.Tensor
    group_size: int
    workspace: torch.Tensor | None = None
    empty: torch.Tensor | None = None       # [E, 0] int32: no act-order indices


def prepare_triton(layer: PackedLayer) -> PreparedWeights:
    """CompressedTensorsWNA16TritonMoE: [E, K//8, N] int32 -> [E, N, K//2] uint8."""
    def to_triton(w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2).contiguous().view(torch.uint8)
    return PreparedWeights("triton_w4a16", to_triton(layer.w13), to_triton(layer.w2), layer.s13, layer.s2,
                           layer.group_size)


def prepare_marlin(layer: PackedLayer) -> PreparedWeights:
    """CompressedTensorsWNA16MoE: Marlin repack of the weights, permuted scales, a workspace."""
    ensure_global_server_args()
    repack = _first("sglang.srt.hardware_backend.gpu.quantization.gptq_kernels:gptq_marlin_moe_repack",
                    "sglang.srt.layers.quantization.gptq:gptq_marlin_moe_repack",
                    "sgl_kernel:gptq_marlin_moe_repack")
    permute_scales = _first("sglang.srt.layers.quantization.marlin_utils:marlin_moe_permute_scales")
    make_workspace = _first("sglang.srt.layers.quantization.marlin_utils:marlin_make_workspace")
    experts, hidden, n = layer.shape
    empty = torch.empty((experts, 0), dtype=torch.int32, device=layer.w13.device)
    w13 = repack(layer.w13, empty, hidden, 2 * n, 4)
    w2 = repack(layer.w2, empty, n, hidden, 4)
    s13 = permute_scales(layer.s13.transpose(1, 2).contiguous(), hidden, 2 * n, layer.group_size)
    s2 = permute_scales(layer.s2.transpose(1, 2).contiguous(), n, hidden, layer.group_size)
    return PreparedWeights("marlin_w4a16", w13, w2, s13, s2, layer.group_size,
                           workspace=make_workspace(layer.w13.device, 4), empty=empty)


def run_prepared(w: PreparedWeights, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 logits: torch.Tensor, routed_scaling_factor: float | None = None) -> torch.Tensor:
    """One MoE layer forward on prepared weights, called as SGLang's scheme calls its kernel."""
    ensure_global_server_args()
    if w.kernel == "triton_w4a16":
        fused_experts = _first("sglang.srt.layers.moe.fused_moe_triton:fused_experts",
                               "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe:fused_experts")
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.topk import StandardTopKOutput
        experts = w.w13.shape[0]
        config = MoeRunnerConfig(num_experts=experts, num_local_experts=experts, inplace=False,
                                 routed_scaling_factor=routed_scaling_factor)
        return fused_experts(x, w.w13, w.w2, StandardTopKOutput(topk_weights, topk_ids, logits), config,
                             use_int4_w4a16=True, w1_scale=w.s13, w2_scale=w.s2, block_shape=[0, w.group_size])
    fused_marlin_moe = _first("sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe:fused_marlin_moe")
    return fused_marlin_moe(x, w.w13, w.w2, w.s13, w.s2, logits, topk_weights, topk_ids,
                            g_idx1=w.empty, g_idx2=w.empty, sort_indices1=w.empty, sort_indices2=w.empty,
                            num_bits=4, is_k_full=True, routed_scaling_factor=routed_scaling_factor,
                            workspace=w.workspace)


def triton_w4a16(p: Problem) -> torch.Tensor:
    """SGLang's Triton fused MoE with use_int4_w4a16, weights converted as CompressedTensorsWNA16TritonMoE does."""
    return run_prepared(prepare_triton(packed_layer(p)), p.x, p.topk_weights, p.topk_ids, p.logits)


def marlin_w4a16(p: Problem) -> torch.Tensor:
    """SGLang's fused Marlin MoE, weights repacked as CompressedTensorsWNA16MoE.process_weights_after_loading does."""
    return run_prepared(prepare_marlin(packed_layer(p)), p.x, p.topk_weights, p.topk_ids, p.logits)


KERNELS: dict[str, Callable[[Problem], torch.Tensor]] = {"triton_w4a16": triton_w4a16, "marlin_w4a16": marlin_w4a16}


def compare(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> dict:
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    finite = bool(torch.isfinite(out).all())
    rel_l2 = float((out - ref).norm() / ref.norm().clamp_min(1e-12)) if finite else float("inf")
    return {"max_abs_err": float(diff.max()) if finite else float("inf"),
            "mean_abs_err": float(diff.mean()) if finite else float("inf"),
            "ref_mean_abs": float(ref.abs().mean()), "rel_l2_err": rel_l2, "finite": finite,
            "tolerance": tolerance, "ok": finite and rel_l2 <= tolerance}


def check_kernels(kernels: dict[str, Callable[[Problem], torch.Tensor]], problem: Problem,
                  tolerance: float = DEFAULT_TOLERANCE) -> dict[str, dict]:
    """Each kernel against the reference: status `pass`, `fail` (numbers), `absent` (not in this SGLang)
    or `error` (it exists but raised)."""
    ref = reference(problem)
    results = {}
    for name, kernel in kernels.items():
        started = time.perf_counter()
        try:
            out = kernel(problem)
        except ImportError as exc:
            results[name] = {"status": "absent", "reason": str(exc)[:500]}
            continue
        except Exception as exc:  # a kernel that exists but cannot run here is reported, not hidden
            results[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:1000]}
            continue
        result = compare(out, ref, tolerance)
        result["status"] = "pass" if result["ok"] else "fail"
        result["seconds"] = round(time.perf_counter() - started, 3)
        results[name] = result
    return results


def refusal(results: dict[str, dict], required: list[str]) -> str | None:
    """Why serving must be refused (a required kernel did not pass), with the numbers; None to serve."""
    bad = []
    for name in required:
        r = results.get(name, {"status": "absent", "reason": "not checked"})
        if r["status"] == "fail":
            bad.append(f"{name} disagrees with the dequantised reference: max abs err {r['max_abs_err']:.4g}, "
                       f"mean abs err {r['mean_abs_err']:.4g} (reference mean |y| {r['ref_mean_abs']:.4g}), "
                       f"relative L2 err {r['rel_l2_err']:.4g} > tolerance {r['tolerance']}")
        elif r["status"] != "pass":
            bad.append(f"{name} could not be checked ({r['status']}: {r.get('reason', '')})")
    return "INT4 MoE kernel self-check refuses to serve: " + "; ".join(bad) if bad else None


def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None, "capability": None}
    try:
        from sglang_patches.applying import sglang_version
        info["sglang"] = sglang_version()
    except Exception as exc:
        info["sglang"] = f"absent ({exc})"
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    return info


def run(kernels: list[str] | None = None, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> dict:
    """Check the named kernels (default: all known) on the GPU; every problem shape of `SHAPES`."""
    chosen = {k: KERNELS[k] for k in (kernels or list(KERNELS))}
    report = {"environment": environment(), "tolerance": tolerance, "problems": []}
    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA device: the W4A16 MoE kernels are CUDA kernels"
        return report
    for shape in SHAPES:
        problem = make_problem("cuda", torch.bfloat16, seed=seed, **shape)
        report["problems"].append({"shape": shape, "results": check_kernels(chosen, problem, tolerance)})
    summary: dict[str, str] = {}
    for prob in report["problems"]:
        for name, r in prob["results"].items():
            prev = summary.get(name, "pass")
            summary[name] = r["status"] if prev == "pass" else prev
    report["summary"] = summary
    return report


# Small problems; the second uses Kimi-K2.5's group size 32 with a decode-sized batch and 8 experts per token.
SHAPES: list[dict] = [
    {"tokens": 32, "hidden": 512, "intermediate": 256, "experts": 8, "topk": 2, "group_size": 32},
    {"tokens": 4, "hidden": 1024, "intermediate": 512, "experts": 16, "topk": 8, "group_size": 32},
    {"tokens": 64, "hidden": 512, "intermediate": 256, "experts": 8, "topk": 2, "group_size": 128},
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--kernels", nargs="*", choices=list(KERNELS), help="default: all")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    args = ap.parse_args(argv)
    report = run(args.kernels, args.tolerance)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    failed = [k for k, v in report.get("summary", {}).items() if v == "fail"]
    if failed:
        print(f"self-check FAILED for {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
