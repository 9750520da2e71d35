"""Where verification turns compute-bound on the Blackwell box: the tokens per step n (c sequences x q verified
tokens) at which the GEMMs' arithmetic, box.flops_ms(n) = 2 x 32 B active parameters x n / (8 GPUs x gemm_tflops),
reaches the memory-bound dense + MoE part of box.target_ms, box.weights_ms(n) (the MoE grown by g(n) from the H200
kernel curve MOE_FIT of docs/journal/2026-12-02-h200/kimi_kernels.json, or the variant's curve, and its fixed share).
Past it the step's max() takes the flops and each further verified token costs its arithmetic.

Range: over the ends of the terms it depends on, gemm_tflops and moe_fixed_share (corners whose baseline contradicts
the measured plateau at every end of bus_gbps dropped, as the bands drop them); mid: every term at its mid.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from experiments.analysis.speedup import box as bx
from experiments.analysis.speedup import box_terms as bt
from experiments.engines.speculation import speculation_of

TERMS = ("gemm_tflops", "moe_fixed_share")
N_MAX = float(1 << 20)   # tokens per step searched; beyond: never compute-bound
SOURCE = ("box.target_ms: max(dense + MoE memory time, flops); MoE: the H200 kernel's ({}: MOE_FIT or the "
          f"measured times of {bt.KERNELS}) x g(n); flops: 2 x {bt.ACTIVE_PARAMS / 1e9:.0f} B active params per token "
          f"over {bt.GPUS} GPUs at gemm_tflops")


def crossover_tokens(v: dict[str, float], shape: bx.MoeShape, moe_scale: float = 1.0) -> float:
    """The smallest tokens per step at which flops_ms reaches weights_ms (bisection after doubling); inf if not
    below N_MAX."""
    def bound(n: float) -> bool:
        return bx.flops_ms(v, n) >= bx.weights_ms(v, shape, n, moe_scale)
    lo, hi = 1.0, 2.0
    if bound(lo):
        return lo
    while not bound(hi):
        if hi >= N_MAX:
            return math.inf
        lo, hi = hi, hi * 2.0
    for _ in range(50):
        mid = (lo + hi) / 2.0
        lo, hi = (lo, mid) if bound(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class Crossover:
    """Tokens per step at which verification turns compute-bound under one engine's MoE kernel."""
    kernel: str
    low: float
    mid: float
    high: float
    corners: tuple[tuple[str, float], ...]   # (the corner's ends by short name, its crossover)

    def where(self, tokens: float) -> str:
        """Whether a step of `tokens` is past the crossover: at every corner, at none, or at mid and some corners."""
        if tokens >= self.high:
            return "yes, at every corner"
        if tokens < self.low:
            return "no, at no corner"
        return "yes at mid, not at every corner" if tokens >= self.mid else "no at mid, yes at some corners"


def _shape(variant: bx.Variant, engine: str) -> tuple[bx.MoeShape, float, str]:
    if speculation_of(engine).int4_moe_kernel == "triton":
        return variant.triton, bt.TRITON_OVER_MARLIN_1, "Triton W4A16"
    return variant.marlin, 1.0, "Marlin W4A16"


def crossover(variant: bx.Variant, engine: str = "sglang") -> Crossover:
    """The crossover at mid and its low / high over the corners of TERMS that reproduce the measured plateau."""
    shape, scale, kernel = _shape(variant, engine)
    terms, base = variant.terms(), bx.mids(variant)
    names = [n for n in TERMS if terms[n].ranged]
    buses = {terms["bus_gbps"].low, terms["bus_gbps"].high}
    corners = []
    for ends in itertools.product(("low", "high"), repeat=len(names)):
        v = base | {n: terms[n].at(e) for n, e in zip(names, ends, strict=True)}
        if any(bx._calibrated(variant, bus, v["moe_fixed_share"], v["gemm_tflops"])[1] for bus in buses):
            label = " ".join(f"{terms[n].short}{'-' if e == 'low' else '+'}" for n, e in zip(names, ends, strict=True))
            corners.append((label, crossover_tokens(v, shape, scale)))
    mid = crossover_tokens(base, shape, scale)
    values = [x for _, x in corners] or [mid]
    return Crossover(kernel, min(values), mid, max(values), tuple(corners))


def _n(x: float) -> str:
    return "never" if math.isinf(x) else f"{math.ceil(x):,}"


def line(cross: Crossover, options: str, variant: str) -> str:
    corners = ", ".join(f"{label} {_n(x)}" for label, x in cross.corners)
    return (f"{options} ({cross.kernel} MoE): verification turns compute-bound at {_n(cross.mid)} tokens per step "
            f"(range {_n(cross.low)}-{_n(cross.high)} over the terms' corners: {corners}; source: "
            f"{SOURCE.format(variant)})")


def rows(specs: list[bx.Spec]) -> list[tuple[str, bx.Spec]]:
    """One row per option, method and k (the crossover does not depend on the drafter)."""
    seen: dict[tuple, tuple[str, bx.Spec]] = {}
    for spec in specs:
        label = spec.label if spec.method == "ngram" else f"{spec.option} EAGLE-3, {spec.k} steps"
        seen.setdefault((spec.option, spec.method, spec.k), (label, spec))
    return list(seen.values())


def table(variant: bx.Variant, specs: list[bx.Spec], levels: tuple[int, ...] = (64, 128)) -> list[str]:
    """Per option row: the tokens one step verifies at each level (c x q) and whether that is past the crossover."""
    lines = [*(line(crossover(variant, e), o, variant.name) for e, o in (("sglang", "A, B (SGLang)"),
                                                                         ("vllm", "C (vLLM)"))), "",
             "| configuration | verified per sequence | " + " | ".join(f"c={c}: tokens per step, compute-bound?"
                                                            for c in levels) + " |", "|---|---|" + "---|" * len(levels)]
    cache: dict[str, Crossover] = {}
    for label, spec in rows(specs):
        cross = cache.setdefault(spec.engine, crossover(variant, spec.engine))
        cells = [f"{c * spec.verified:,.0f}: {cross.where(c * spec.verified)}" for c in levels]
        lines.append(f"| {label} | {spec.verified:g} | " + " | ".join(cells) + " |")
    if any(math.isinf(x) for cross in cache.values() for _, x in cross.corners):
        lines += ["", "never: at that corner the memory-bound part grows per token as fast as the flops (no fixed MoE "
                  "share: the H200 kernel's per-token cost, scaled to the box's MoE time, grows as fast as the "
                  "arithmetic at that throughput)"]
    return lines
