"""The Blackwell box's speedup as bands, from the named terms of experiments/analysis/speedup/box_terms.py.

Step time in ms with c sequences verifying q tokens each (q = 1: the baseline's decode step), T1 = 12.12 ms:
    allreduce = 51.5 % T1 + (c q - 1) x (122 all-reduces of 7168 bf16 + the logits' all-gather) per token / bus
    attention = 15.3 % T1 x (1 + gamma (c - 1)) x (1 + beta (q - 1))   gamma: fitted so that c = 128 gives 1,536 tok/s
    gemm      = max(13.4 % T1 + 11.1 % T1 x g(c q), 2 x 32 B params x c q / (8 GPUs x throughput))
    other     = the rest of T1
  + the engine's overhead per speculative step (fixed + per sequence)
  + EAGLE-3's draft: num_steps forwards (num_steps - 1 drafting c tokens, one extend over c q), each reading its layer
    and LM head per rank at the draft's bandwidth, 2 all-reduces and the logits' all-gather; its fc once
  + SGLang above the verify graphs' cap (c > 32): every forward eager, launches per layer.
g(n) = phi + (1 - phi) V(n) / V(1): MoE time for n tokens over one, V the H200 kernel's time past its fixed part (the
fit's per-expert and per-token costs over uniform routing or a measured expert curve, or the kernel's measured
times), phi the fixed share on the box. vLLM (option C) runs its MoE on Triton W4A16 (conf/site/blackwell.yaml).
speedup = tau T(c, 1) / T_spec(c, q), tau the tokens per step; decode only (prefill left out).

Band: min / max over every corner of the configuration's ranged terms, acceptance at its low / high end; corners whose
baseline at c = 128 is more than 5 % slower than the measured plateau contradict it and are dropped. Point: every term
at its mid. Sensitivity: each ranged term at its low and high end, the others at mid: the terms that flip the point's
verdict; where a band straddles 1, the terms (or pairs) that keep it open (Band.kept_open_by). Where the max() turns
to the flops: experiments/analysis/speedup/box_compute.py. The engine's overhead ranges over the hosts seen:
box_hosts.py. CLI: `python -m experiments.analysis.speedup.cli box` (experiments/analysis/speedup/box_report.py).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from experiments.analysis.speedup import box_terms as bt
from experiments.analysis.speedup.box_terms import DRAFTERS, TERMS, BandUnavailable, Term
from experiments.analysis.speedup.model import expected_distinct_experts
from experiments.engines.speculation import speculation_of

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
SEED_MEASURED = (0.74, 0.91)   # the seed's n-gram on the box: 9-26 % slower than no speculation (design.md)
T1 = 1000.0 / bt.SINGLE_STREAM_TOK_S
REST = 1.0 - sum(bt.SHARES.values())
AR_CALL_MS = bt.SHARES["allreduce"] * T1 / (bt.LAYERS * bt.ALLREDUCES_PER_LAYER)   # latency of one call at c = 1
BASE_TERMS = ("bus_gbps", "moe_fixed_share", "gemm_tflops")


@dataclass(frozen=True)
class MoeShape:
    """V(n), the MoE call's time past its fixed part for n routed tokens, in us on the H200."""
    name: str
    fit: tuple[float, float, float]            # fixed, per distinct expert, per token (us)
    curve: tuple[float, ...] | None = None     # measured distinct experts at 1, 2, ... tokens
    times: tuple[tuple[float, float], ...] | None = None   # measured (tokens, us)
    fixed_share: float | None = None           # pinned: the measured curve as it is (the kernel variant)

    def distinct(self, n: float) -> float:
        """Uniform routing, or the measured curve (past its end: the uniform shape scaled to meet its last point,
        as BoxProfile.distinct_experts)."""
        uniform = expected_distinct_experts(n, bt.EXPERTS, bt.TOP_K)
        if not self.curve:
            return uniform
        if n <= len(self.curve):
            return float(np.interp(n, np.arange(1, len(self.curve) + 1), self.curve))
        last = len(self.curve)
        return min(float(bt.EXPERTS), self.curve[-1] / expected_distinct_experts(last, bt.EXPERTS, bt.TOP_K) * uniform)

    def variable(self, n: float) -> float:
        fixed, per_expert, per_token = self.fit
        if self.times:
            tokens, us = zip(*self.times, strict=True)
            return max(1e-6, float(np.interp(n, tokens, us)) - fixed)
        return per_expert * self.distinct(n) + per_token * n

    def growth(self, n: float, phi: float) -> float:
        phi = phi if self.fixed_share is None else self.fixed_share
        return phi + (1.0 - phi) * self.variable(n) / self.variable(1.0)


@dataclass(frozen=True)
class Variant:
    """How the MoE term grows: SGLang's Marlin and vLLM's Triton kernel shapes; `pinned` fixes ranged terms."""
    name: str
    marlin: MoeShape
    triton: MoeShape
    pinned: tuple[tuple[str, float], ...] = ()

    def terms(self) -> dict[str, Term]:
        return TERMS | {n: replace(TERMS[n], low=x, mid=x, high=x) for n, x in self.pinned}


def uniform_variant() -> Variant:
    return Variant("uniform routing", MoeShape("uniform", bt.MOE_FIT["marlin_w4a16"]),
                   MoeShape("uniform", bt.MOE_FIT["triton_w4a16"]))


def curve_variant(curve: list[float], label: str) -> Variant:
    c = tuple(curve)
    return Variant(f"expert curve {label}", MoeShape("curve", bt.MOE_FIT["marlin_w4a16"], c),
                   MoeShape("curve", bt.MOE_FIT["triton_w4a16"], c))


def kernel_fit(path: Path, kernel: str, n: int = 256) -> tuple[tuple[float, float, float], list[tuple[float, float]]]:
    """Least squares us = fixed + per_expert x distinct + per_token x tokens over a kernel microbenchmark's uniform
    rows at shard width n (experiments/box/kimi_kernels.py JSON), and its measured (tokens, us)."""
    rows = sorted((r for r in json.loads(Path(path).read_text())["rows"].values()
                   if r["N"] == n and r.get("routing") == "uniform" and (r.get(kernel) or {}).get("us")),
                  key=lambda r: r["M"])
    if len(rows) < 3 or rows[0]["M"] != 1:
        raise BandUnavailable(f"{path}: fewer than 3 {kernel} rows at N={n} from one token")
    m = np.array([r["M"] for r in rows], float)
    d = np.array([r["distinct_experts"] for r in rows], float)
    us = np.array([r[kernel]["us"] for r in rows], float)
    cols = [np.ones_like(m), d, m]
    sol = np.linalg.lstsq(np.stack(cols, 1), us, rcond=None)[0]
    if sol[2] < 0:   # no per-token cost to fit: fixed + per expert
        sol = np.append(np.linalg.lstsq(np.stack(cols[:2], 1), us, rcond=None)[0], 0.0)
    return tuple(float(x) for x in sol), [(float(a), float(b)) for a, b in zip(m, us, strict=True)]  # type: ignore


def kernel_variant(path: Path) -> Variant:
    """The H200's measured MoE times carried to the box as they are: each kernel's fixed share pinned at its own."""
    shapes = []
    for kernel in ("marlin_w4a16", "triton_w4a16"):
        fit, times = kernel_fit(path, kernel)
        shapes.append(MoeShape("kernel", fit, times=tuple(times), fixed_share=fit[0] / times[0][1]))
    return Variant(f"H200 kernel times {Path(path).name}", *shapes,
                   pinned=(("moe_fixed_share", shapes[0].fixed_share or 0.0),))


@dataclass(frozen=True)
class Spec:
    """One configuration of the table: option, method, engine, k (A: num_draft_tokens; B, C: draft steps)."""
    option: str
    method: str
    engine: str
    k: int
    drafter: str | None = None

    @property
    def verified(self) -> float:
        """Tokens a step verifies per sequence: SGLang NGRAM its whole draft of num_draft_tokens (the root
        included); EAGLE-3 with topk 1, SGLang and vLLM alike, num_steps + 1."""
        return float(self.k) if self.method == "ngram" else float(self.k + 1)

    @property
    def label(self) -> str:
        if self.method == "ngram":
            return f"{self.option} n-gram, {self.k} draft tokens"
        return f"{self.option} {self.drafter}, {self.k} steps"

    def terms(self) -> list[str]:
        own = ["attn_verify_growth"]
        prefix = speculation_of(self.engine).overhead_terms(self.method)
        own += [f"{prefix}_overhead_ms", f"{prefix}_overhead_seq_ms"]
        if self.method == "eagle3":
            own.append("draft_tbps")
        if speculation_of(self.engine).eager_above_verify_graph_cap:
            own.append("eager_ms_per_layer")
        return [*BASE_TERMS, *own]

    def accept(self) -> tuple[float, float, float]:
        if self.method == "ngram":
            return bt.ngram_accept(self.k)
        return bt.eagle_accept(DRAFTERS[self.drafter or ""], self.k)

    def vocab(self) -> tuple[int, int]:
        return DRAFTERS[self.drafter].vocab if self.drafter else (bt.VOCAB, bt.VOCAB)


def configs() -> list[Spec]:
    a = [Spec("A", "ngram", "sglang", k) for k in (2, 4, 8)]
    b = [Spec("B", "eagle3", "sglang", s, d) for d in DRAFTERS for s in range(1, 6)]
    c = [Spec("C", "eagle3", "vllm", 3, d) for d in DRAFTERS]
    return a + b + c


def comm_ms_per_token(bus_gbps: float) -> float:
    """Per token in the step: the 122 all-reduces' ring volume and the vocab-parallel logits' all-gather."""
    ring = 2.0 * (bt.GPUS - 1) / bt.GPUS * bt.HIDDEN * 2 * bt.LAYERS * bt.ALLREDUCES_PER_LAYER
    gather = (bt.GPUS - 1) / bt.GPUS * bt.VOCAB * 2
    return (ring + gather) / (bus_gbps * 1e9) * 1e3


def weights_ms(v: dict[str, float], shape: MoeShape, n: float, moe_scale: float) -> float:
    """The dense and MoE part of a step over n tokens while memory-bound: the weights read, MoE grown by g(n)."""
    return bt.SHARES["dense"] * T1 + bt.SHARES["moe"] * T1 * moe_scale * shape.growth(n, v["moe_fixed_share"])


def flops_ms(v: dict[str, float], n: float) -> float:
    """The same GEMMs' arithmetic over n tokens: 2 x the active parameters per token over 8 GPUs' throughput."""
    return 2.0 * bt.ACTIVE_PARAMS / (bt.GPUS * v["gemm_tflops"] * 1e12) * 1e3 * n


def target_ms(v: dict[str, float], shape: MoeShape, c: float, q: float, gamma: float, moe_scale: float) -> float:
    n = c * q
    allreduce = bt.SHARES["allreduce"] * T1 + comm_ms_per_token(v["bus_gbps"]) * (n - 1.0)
    attention = bt.SHARES["attention"] * T1 * (1.0 + gamma * (c - 1.0)) * (1.0 + v["attn_verify_growth"] * (q - 1.0))
    return allreduce + attention + max(weights_ms(v, shape, n, moe_scale), flops_ms(v, n)) + REST * T1


def calibrate(v: dict[str, float], shape: MoeShape) -> tuple[float, bool]:
    """(attention growth per sequence that puts the baseline on the measured plateau, whether the corner can)."""
    c = bt.PLATEAU_C
    target = c * 1000.0 / bt.PLATEAU_TOK_S
    without = target_ms({**v, "attn_verify_growth": 0.0}, shape, c, 1.0, 0.0, 1.0)
    gamma = (target - without) / (bt.SHARES["attention"] * T1 * (c - 1))
    return max(0.0, gamma), without <= target * (1.0 + bt.PLATEAU_TOLERANCE)


def draft_ms(v: dict[str, float], steps: int, c: float, q: float, vocab: float) -> float:
    layer, fc = bt.draft_bytes_per_rank(int(vocab))
    bw, flops = v["draft_tbps"] * 1e12, v["gemm_tflops"] * 1e12
    per_token = (2.0 * (bt.GPUS - 1) / bt.GPUS * bt.HIDDEN * 2 * 2 + (bt.GPUS - 1) / bt.GPUS * vocab * 2) \
        / (v["bus_gbps"] * 1e9) * 1e3

    def forward(tokens: float) -> float:
        return max(layer / bw, layer * tokens / flops) * 1e3 + 3 * AR_CALL_MS + per_token * tokens
    return (steps - 1) * forward(c) + forward(c * q) + fc / bw * 1e3


def spec_extra_ms(v: dict[str, float], spec: Spec, c: float, vocab: float) -> float:
    rules = speculation_of(spec.engine)
    prefix = rules.overhead_terms(spec.method)
    extra = v[f"{prefix}_overhead_ms"] + v[f"{prefix}_overhead_seq_ms"] * c
    forwards = 0
    if spec.method == "eagle3":
        extra += draft_ms(v, spec.k, c, spec.verified, vocab)
        forwards = spec.k
    if rules.eager_above_verify_graph_cap and c > bt.VERIFY_GRAPH_CAP:
        extra += v["eager_ms_per_layer"] * (bt.LAYERS + forwards)
    return extra


def speedup(v: dict[str, float], variant: Variant, spec: Spec, c: float, tau: float, vocab: float) -> float:
    gamma, _ = _calibrated(variant, *(v[t] for t in BASE_TERMS))
    triton = speculation_of(spec.engine).int4_moe_kernel == "triton"
    shape, scale = (variant.triton, bt.TRITON_OVER_MARLIN_1) if triton else (variant.marlin, 1.0)
    base = target_ms(v, shape, c, 1.0, gamma, scale)
    spec_ms = target_ms(v, shape, c, spec.verified, gamma, scale) + spec_extra_ms(v, spec, c, vocab)
    return tau * base / spec_ms


@lru_cache(maxsize=4096)
def _calibrated(variant: Variant, bus: float, phi: float, tflops: float) -> tuple[float, bool]:
    return calibrate({"bus_gbps": bus, "moe_fixed_share": phi, "gemm_tflops": tflops, "attn_verify_growth": 0.0},
                     variant.marlin)


def mids(variant: Variant) -> dict[str, float]:
    return {name: t.mid for name, t in variant.terms().items()}


@dataclass
class Band:
    spec: Spec
    accept: tuple[float, float, float]
    low: dict[int, float]
    point: dict[int, float]
    high: dict[int, float]
    corners: list[dict[str, str]] = field(default_factory=list)    # which end of each ranged term, per corner
    samples: dict[int, list[float]] = field(default_factory=dict)   # speedup per corner at one token per step
    dropped: int = 0

    def verdict(self, c: int) -> str:
        return _verdict(self.low[c], self.high[c])

    def settled_by(self, c: int) -> list[str]:
        """Where the band straddles 1: the terms that, pinned at one end (`name-` low, `name+` high) with the others
        over their ranges, give a band wholly above or below 1 -- the measurements that could decide the verdict."""
        if self.verdict(c) != "inconclusive":
            return []
        out = []
        for name in self.corners[0]:
            for end, sign in (("low", "-"), ("high", "+")):
                values = [s for s, e in zip(self.samples[c], self.corners, strict=True) if e[name] == end]
                if _verdict(self.accept[0] * min(values), self.accept[2] * max(values)) != "inconclusive":
                    out.append(name + sign)
        for tau, sign in ((self.accept[0], "-"), (self.accept[2], "+")):
            if _verdict(tau * min(self.samples[c]), tau * max(self.samples[c])) != "inconclusive":
                out.append("accept" + sign)
        return out

    def kept_open_by(self, c: int) -> list[str]:
        """Where the band straddles 1: the terms whose range keeps it open -- settled_by, or where no single term
        settles it, the pairs (`a- & b+`) that pinned together at those ends, the rest over their ranges, do."""
        single = self.settled_by(c)
        if single or self.verdict(c) != "inconclusive":
            return single
        pins = [(f"{n}{sign}", [e[n] == end for e in self.corners], (self.accept[0], self.accept[2]))
                for n in self.corners[0] for end, sign in (("low", "-"), ("high", "+"))]
        pins += [(f"accept{sign}", [True] * len(self.corners), (tau, tau))
                 for tau, sign in ((self.accept[0], "-"), (self.accept[2], "+"))]
        out = []
        for (a, mask_a, tau_a), (b, mask_b, tau_b) in itertools.combinations(pins, 2):
            values = [s for s, x, y in zip(self.samples[c], mask_a, mask_b, strict=True) if x and y]
            if a.rstrip("+-") == b.rstrip("+-") or not values:
                continue
            lo, hi = max(tau_a[0], tau_b[0]), min(tau_a[1], tau_b[1])
            if _verdict(lo * min(values), hi * max(values)) != "inconclusive":
                out.append(f"{a} & {b}")
        return out


def _verdict(low: float, high: float) -> str:
    return "pays" if low > 1.0 else "does not pay" if high < 1.0 else "inconclusive"


def corners(spec: Spec, variant: Variant) -> tuple[list[tuple[dict[str, str], dict[str, float], float]], int]:
    """Every combination of the ends of the spec's ranged terms (and its drafter's vocabulary), consistent with
    the measured plateau: (ends by short name, values, vocabulary); and how many were dropped for contradicting it."""
    terms = variant.terms()
    names = [n for n in spec.terms() if terms[n].ranged]
    vocabs = dict(zip(("low", "high"), spec.vocab(), strict=True))
    if vocabs["low"] == vocabs["high"]:
        vocabs = {"low": vocabs["low"]}
    kept, dropped = [], 0
    for ends in itertools.product(("low", "high"), repeat=len(names)):
        v = mids(variant) | {n: terms[n].at(e) for n, e in zip(names, ends, strict=True)}
        if not _calibrated(variant, *(v[t] for t in BASE_TERMS))[1]:
            dropped += len(vocabs)
            continue
        labels = {terms[n].short: e for n, e in zip(names, ends, strict=True)}
        kept += [(labels | ({"vocab": e} if len(vocabs) > 1 else {}), v, float(x)) for e, x in vocabs.items()]
    return kept, dropped


def band(spec: Spec, variant: Variant, levels: tuple[int, ...] = LEVELS) -> Band:
    accept = spec.accept()
    kept, dropped = corners(spec, variant)
    if not kept:
        raise BandUnavailable(f"{spec.label}: no corner of its terms reproduces the measured plateau")
    vocab_mid = float(np.mean(spec.vocab()))
    b = Band(spec, accept, {}, {}, {}, [ends for ends, _, _ in kept], {}, dropped)
    for c in levels:
        b.samples[c] = [speedup(v, variant, spec, c, 1.0, vocab) for _, v, vocab in kept]
        b.low[c], b.high[c] = accept[0] * min(b.samples[c]), accept[2] * max(b.samples[c])
        b.point[c] = speedup(mids(variant), variant, spec, c, accept[1], vocab_mid)
    return b


def engine_factor(variant: Variant, c: float) -> float:
    """vLLM's baseline step over SGLang's at mid (MoE on Triton W4A16): what option C's ratio against its own
    baseline is multiplied by to compare with the box's SGLang baseline."""
    v = mids(variant)
    gamma, _ = calibrate(v, variant.marlin)
    return target_ms(v, variant.marlin, c, 1.0, gamma, 1.0) / \
        target_ms(v, variant.triton, c, 1.0, gamma, bt.TRITON_OVER_MARLIN_1)


def sensitivity(spec: Spec, variant: Variant, levels: tuple[int, ...] = LEVELS) -> dict[int, list[str]]:
    """Per level: the terms (short names) whose low or high end, the others at mid, moves the point across 1."""
    accept = spec.accept()
    lo_vocab, hi_vocab = spec.vocab()
    vocab_mid = (lo_vocab + hi_vocab) / 2
    terms, base = variant.terms(), mids(variant)
    out: dict[int, list[str]] = {}
    for c in levels:
        mid = speedup(base, variant, spec, c, accept[1], vocab_mid)
        ends: dict[str, list[float]] = {}
        for n in (n for n in spec.terms() if terms[n].ranged):
            ends[terms[n].short] = [speedup(base | {n: terms[n].at(e)}, variant, spec, c, accept[1], vocab_mid)
                                    for e in ("low", "high")]
        ends["accept"] = [mid * accept[0] / accept[1], mid * accept[2] / accept[1]]
        if lo_vocab < hi_vocab:
            ends["vocab"] = [speedup(base, variant, spec, c, accept[1], x) for x in (lo_vocab, hi_vocab)]
        out[c] = [name for name, s in ends.items() if any((x > 1.0) != (mid > 1.0) for x in s)]
    return out


@dataclass
class SeedCheck:
    band: Band
    reproduces: bool
    reason: str


def seed_check(variant: Variant, levels: tuple[int, ...] = LEVELS) -> SeedCheck:
    """The seed's n-gram on the box ran 9-26 % slower (0.74-0.91x) where its first model said n-gram pays.
    Reproduced when, for A at 4 draft tokens and the reasoning prompts' acceptance, the band overlaps 0.74-0.91 at
    every level (the measured loss is not excluded where it might have been measured) and no level's band lies
    above 1 (the model does not say "pays" anywhere)."""
    b = band(Spec("A", "ngram", "sglang", 4), variant, levels)
    lo, hi = SEED_MEASURED
    apart = [c for c in levels if b.high[c] < lo or b.low[c] > hi]
    pays = [c for c in levels if b.verdict(c) == "pays"]
    reason = "; ".join(x for x in (
        f"band misses {lo}-{hi} at c={apart}" if apart else "",
        f"band says pays at c={pays}" if pays else "") if x) or \
        f"the band overlaps {lo}-{hi} and does not say pays at any c"
    return SeedCheck(b, not apart and not pays, reason)
