"""Speedup model: output tok/s and speedup of a speculative configuration at each concurrency, from
(a) the baseline's per-step cost profile, (b) the acceptance (tokens per step, measured or replayed),
(c) the draft's cost, (d) how verification cost grows with the tokens verified per step.

Per decode step a request verifies q = 1 + k * (share of steps with a draft) tokens and emits tau tokens.
    speedup(c) = 1 / (phi + (1 - phi) * T(c, q) / (tau * T(c, 1)))
T(c, q): step time with c sequences of q tokens each (+ the draft's cost), phi: the share of a request's
time spent before its first token (prefill and queueing, which speculation does not shorten).

Profiles:
- `LinearProfile` (engines here): T = a + b * c * q, fitted to the baseline run's time per output token at
  each measured concurrency (every baseline step emits one token per request).
- `BoxProfile` (the Blackwell box): mission.md's decode-time shares at single stream, each component grown
  with the tokens in the step: AllReduce = latency + volume (hidden * bytes per token over the PCIe bus),
  MoE GEMMs in proportion to the distinct experts a layer touches (expected value for n tokens routed
  top-k of E, or a measured curve), dense GEMMs flat up to a compute ridge, attention per sequence with a
  coefficient calibrated so that the baseline reproduces the measured plateau (1,536 tok/s at 128).

Inputs from a store and the verification-cost probes: experiments/analysis/speedup/fit.py; the CLI
(`python -m experiments.analysis.speedup.cli table | box`): experiments/analysis/speedup/cli.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from experiments.config.kimi import KIMI

if TYPE_CHECKING:
    from experiments.analysis.runs import RunConfig
    from experiments.config.views import SpecView

DRAFT_STEP_COST = {"ngram": 0.0, "eagle3": 0.12}   # per draft step, relative to a baseline step at c=1


class PredictionUnavailable(ValueError):
    """The model lacks an input it needs; the message says which."""


def expected_distinct_experts(tokens: float, experts: int, top_k: int) -> float:
    """E * (1 - (1 - k/E)^n): distinct experts one MoE layer touches for n tokens routed uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass
class LinearProfile:
    """T(c, q) = a + b_seq * c + b_tok * c * (q - 1): the baseline fixes a and b_seq (its steps carry one
    token per sequence); b_tok, the cost of one more verified token, comes from a verification probe
    (step time vs draft tokens verified, from single-stream n-gram records) or, lacking one, equals b_seq."""
    a_ms: float
    b_seq_ms: float
    b_tok_ms: float | None = None
    spec_overhead_ms: float = 0.0      # fixed cost of a speculative step (SGLang probe; 0 unless measured)
    spec_overhead_seq_ms: float = 0.0  # and per sequence in the batch (SGLang probe)

    def step_ms(self, c: float, q: float) -> float:
        b_tok = self.b_seq_ms if self.b_tok_ms is None else self.b_tok_ms
        return (self.a_ms + self.b_seq_ms * c + b_tok * c * (q - 1.0)
                + (self.spec_overhead_ms + self.spec_overhead_seq_ms * c if q > 1.0 else 0.0))

    @classmethod
    def from_levels(cls, step_ms_by_c: dict[int, float], b_tok_ms: float | None = None,
                    spec_overhead_ms: float = 0.0, spec_overhead_seq_ms: float = 0.0) -> LinearProfile:
        if not step_ms_by_c:
            raise PredictionUnavailable("baseline has no per-concurrency time per output token")
        cs = np.array(sorted(step_ms_by_c), dtype=float)
        ts = np.array([step_ms_by_c[int(c)] for c in cs])
        if len(cs) == 1:  # one level: all cost fixed (memory-bound decode), a lower bound on growth
            return cls(float(ts[0]), 0.0, b_tok_ms, spec_overhead_ms, spec_overhead_seq_ms)
        b, a = np.polyfit(cs, ts, 1)
        return cls(float(max(a, 0.0)), float(max(b, 0.0)), b_tok_ms, spec_overhead_ms, spec_overhead_seq_ms)


@dataclass
class BoxProfile:
    """Kimi-K2.5 INT4, SGLang TP8 on 8x RTX PRO 6000 over PCIe (mission.md)."""
    single_stream_tok_s: float = 82.5
    plateau_tok_s: float = 1536.0
    plateau_concurrency: int = 128
    share_allreduce: float = 0.515
    share_attention: float = 0.153
    share_dense: float = 0.134
    share_moe: float = 0.111
    experts: int = KIMI.routed_experts
    top_k: int = KIMI.top_k
    hidden: int = KIMI.hidden
    layers: int = KIMI.layers
    allreduces_per_layer: int = 2
    allreduce_bytes: int = 2                 # bf16 activations
    gpus: int = 8
    bus_gbps: float = 25.0                   # effective PCIe all-reduce bus bandwidth
    active_params: float = 32e9              # parameters a token passes through (Kimi-K2: 32 B activated)
    gpu_tflops: float = 200.0                # effective GEMM throughput per GPU (W4A16 kernels, SM120)
    expert_curve: list[float] | None = None  # measured distinct experts per layer at 1, 2, ... tokens
    # measured MoE kernel time at (tokens, time / time at 1 token); replaces "in proportion to distinct experts"
    moe_time_curve: list[tuple[float, float]] | None = None
    attention_growth: float = field(default=float("nan"), init=False)

    def __post_init__(self) -> None:
        self.t1_ms = 1000.0 / self.single_stream_tok_s
        self.attention_growth = 0.0
        target = self.plateau_concurrency * 1000.0 / self.plateau_tok_s
        rest = self.step_ms(self.plateau_concurrency, 1.0)
        per_seq = self.share_attention * self.t1_ms * (self.plateau_concurrency - 1)
        self.attention_growth = max(0.0, (target - rest) / per_seq)

    def distinct_experts(self, tokens: float) -> float:
        if self.expert_curve:
            curve = np.asarray(self.expert_curve, dtype=float)
            if tokens <= len(curve):
                return float(np.interp(tokens, np.arange(1, len(curve) + 1), curve))
            # past the measured range: the uniform-routing shape, scaled to meet the curve's last point
            scale = curve[-1] / expected_distinct_experts(len(curve), self.experts, self.top_k)
            return min(float(self.experts), scale * expected_distinct_experts(tokens, self.experts, self.top_k))
        return expected_distinct_experts(tokens, self.experts, self.top_k)

    def moe_growth(self, tokens: float) -> float:
        """MoE GEMM time for `tokens` routed tokens relative to one: the measured kernel curve (held at its last
        point past the measured range), else in proportion to the distinct experts the tokens touch."""
        if self.moe_time_curve:
            m, rel = (np.asarray(v, dtype=float) for v in zip(*self.moe_time_curve, strict=True))
            return float(np.interp(tokens, m, rel))
        return self.distinct_experts(tokens) / self.distinct_experts(1)

    def allreduce_ms_per_token(self) -> float:
        ring = 2.0 * (self.gpus - 1) / self.gpus
        per_call = ring * self.hidden * self.allreduce_bytes / (self.bus_gbps * 1e9) * 1e3
        return per_call * self.layers * self.allreduces_per_layer

    def components_ms(self, c: float, q: float) -> dict[str, float]:
        n = c * q
        t1 = self.t1_ms
        rest = 1.0 - self.share_allreduce - self.share_attention - self.share_dense - self.share_moe
        return {
            "allreduce": self.share_allreduce * t1 + self.allreduce_ms_per_token() * (n - 1),
            "attention": self.share_attention * t1 * (1.0 + self.attention_growth * (c - 1)),
            # GEMMs read weights (dense: fixed; MoE: per distinct expert) or, with enough tokens, are
            # bound by their FLOPs: whichever is longer
            "gemm": max(self.share_dense * t1 + self.share_moe * t1 * self.moe_growth(n),
                        self.gemm_compute_ms_per_token() * n),
            "other": rest * t1,
        }

    def gemm_compute_ms_per_token(self) -> float:
        return 2.0 * self.active_params / (self.gpus * self.gpu_tflops * 1e12) * 1e3

    def step_ms(self, c: float, q: float) -> float:
        return sum(self.components_ms(c, q).values())


def load_moe_time_curve(path: Path, n: int = 256, kernel: str = "marlin_w4a16",
                        routing: str = "uniform") -> list[tuple[float, float]]:
    """(tokens, time relative to one token) of one MoE kernel at one expert shard width N, from the kernel
    microbenchmark's JSON (experiments/box/kimi_kernels.py); N = 256 is Kimi-K2.5's TP-8 shard."""
    rows = json.loads(Path(path).read_text())["rows"].values()
    points = sorted((r["M"], r[kernel]["us"]) for r in rows
                    if r["N"] == n and r.get("routing") == routing and (r.get(kernel) or {}).get("us"))
    if not points or points[0][0] != 1:
        raise PredictionUnavailable(f"{path}: no {kernel} time at N={n}, {routing} routing, 1 token")
    return [(float(m), us / points[0][1]) for m, us in points]


def load_expert_curve(path: Path, experts: int, top_k: int) -> list[float]:
    """Distinct experts per MoE layer at 1, 2, ... tokens per step, from a JSON list or from the telemetry
    file experiments/moe writes ({num_experts, top_k, growth: [{tokens_per_step, mean_distinct}]}). A curve
    measured on a different MoE is carried over as its ratio to uniform routing at each token count."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return [float(v) for v in data]
    points = sorted((int(p["tokens_per_step"]), float(p["mean_distinct"])) for p in data["growth"])
    n = np.arange(1, points[-1][0] + 1)
    measured = np.interp(n, [p[0] for p in points], [p[1] for p in points])
    e, k = int(data.get("num_experts", experts)), int(data.get("top_k", top_k))
    ratio = measured / np.array([expected_distinct_experts(x, e, k) for x in n])
    return [float(r * expected_distinct_experts(x, experts, top_k)) for r, x in zip(ratio, n, strict=True)]


@dataclass
class Prediction:
    concurrency: int
    tokens_per_step: float
    verified_per_step: float
    speedup: float
    output_tok_s: float | None
    break_even_tokens_per_step: float   # tokens per step at which this configuration breaks even
    break_even_accept_length: float     # the same, per drafted step with all k drafted (vLLM's definition)


def speedup(profile, c: float, tau: float, q: float, draft_ms: float, prefill_share: float) -> float:
    decode_ratio = (profile.step_ms(c, q) + draft_ms) / (tau * profile.step_ms(c, 1.0))
    return 1.0 / (prefill_share + (1.0 - prefill_share) * decode_ratio)


def predict_level(profile, c: int, tau: float, k: int, draft_share: float, draft_step_cost: float,
                  prefill_share: float = 0.0, base_tok_s: float | None = None,
                  verified: float | None = None) -> Prediction:
    """verified: tokens verified per step where the engine fixes it (SGLang verifies its whole draft tree,
    num_draft_tokens including the root, on every step), else 1 + k * draft share (vLLM)."""
    q = 1.0 + k * draft_share if verified is None else verified
    draft_ms = draft_step_cost * k * draft_share * profile.step_ms(1, 1.0)
    s = speedup(profile, c, tau, q, draft_ms, prefill_share)
    be_tau = (profile.step_ms(c, q) + draft_ms) / profile.step_ms(c, 1.0)
    full_draft_ms = draft_step_cost * k * profile.step_ms(1, 1.0)
    be_al = (profile.step_ms(c, 1.0 + k if verified is None else verified) + full_draft_ms) / profile.step_ms(c, 1.0)
    return Prediction(c, tau, q, s, None if base_tok_s is None else base_tok_s * s, be_tau, be_al)


def break_even_concurrency(profile, tau: float, k: int, draft_share: float, draft_step_cost: float,
                           c_max: float = 4096.0, verified: float | None = None) -> float:
    """Lowest concurrency at which the decode speedup drops to 1 (inf: pays up to c_max; 0: never pays).
    Scanned, not bisected: on an MoE the speedup need not fall monotonically (experts saturate)."""
    def gain(c: float) -> float:
        return predict_level(profile, c, tau, k, draft_share, draft_step_cost, verified=verified).speedup - 1.0
    if gain(1.0) <= 0:
        return 0.0
    grid = np.geomspace(1.0, c_max, 400)
    below = [c for c in grid if gain(c) <= 0]
    if not below:
        return math.inf
    hi = below[0]
    lo = grid[max(0, int(np.searchsorted(grid, hi)) - 1)]
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return hi


def accept_length_for_rate(alpha: float, k: int) -> float:
    """Tokens per drafted step when each draft token is accepted with probability alpha, independently."""
    return float(sum(alpha ** i for i in range(k + 1)))


def break_even_acceptance_rate(target_accept_length: float, k: int) -> float:
    if target_accept_length >= k + 1:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accept_length_for_rate(mid, k) < target_accept_length else (lo, mid)
    return hi


# ---------------------------------------------------------------- inputs from logged metrics

def levels_of(metrics: dict[str, float]) -> list[int]:
    return sorted(int(k.removeprefix("output_tok_s_c")) for k in metrics if k.startswith("output_tok_s_c"))


def baseline_profile(base: dict[str, float], b_tok_ms: float | None = None, spec_overhead_ms: float = 0.0,
                     max_c: int | None = None, spec_overhead_seq_ms: float = 0.0) -> LinearProfile:
    """Time per output token of the baseline at each concurrency = its step time there (levels above
    max_c left out: e.g. above SGLang's CUDA-graph batch limit, another regime than the levels below)."""
    return LinearProfile.from_levels({c: base[f"tpot_mean_ms_c{c}"] for c in levels_of(base)
                                      if f"tpot_mean_ms_c{c}" in base and (max_c is None or c <= max_c)},
                                     b_tok_ms, spec_overhead_ms, spec_overhead_seq_ms)


def draft_length(spec: SpecView) -> tuple[str, int]:
    """(method, k): the draft tokens per step an n-gram run proposes, the draft steps of an EAGLE-3 run."""
    if spec.method not in ("ngram", "eagle3"):
        raise PredictionUnavailable(f"no speculation to predict (spec.method={spec.method})")
    key = "num_draft_tokens" if spec.method == "ngram" else "num_steps"
    k = getattr(spec, key)
    if k is None:
        raise PredictionUnavailable(f"spec.{key} not set")
    return spec.method, int(k)


def level_acceptance(m: dict[str, float], c: int, drafts: float | None = None) -> tuple[float, float]:
    """(tokens per decode step, share of steps with a draft) at one concurrency level, from the engine's
    counters where the level has them, else from the streamed chunks (one per step when not merged)."""
    decode_tokens = m[f"output_tokens_c{c}"] - m[f"requests_c{c}"]
    chunks = m[f"output_tokens_c{c}"] / m[f"tokens_per_chunk_c{c}"] if m.get(f"tokens_per_chunk_c{c}") else None
    if drafts is None and chunks and f"steps_with_draft_c{c}" in m:
        drafts = m[f"steps_with_draft_c{c}"] * chunks
    al = m.get(f"accept_length_c{c}")
    if drafts and al:
        steps = max(decode_tokens - drafts * (al - 1.0), drafts)
        return decode_tokens / steps, min(1.0, drafts / steps)
    if chunks and chunks > m[f"requests_c{c}"]:
        return decode_tokens / (chunks - m[f"requests_c{c}"]), 1.0
    raise PredictionUnavailable(f"no acceptance for concurrency {c}")


def predict_run(option: dict[str, float], config: RunConfig, base: dict[str, float],
                drafts_by_level: dict[int, float] | None = None,
                tokens_per_step: dict[int, tuple[float, float]] | None = None,
                draft_step_cost: float | None = None, b_tok_ms: float | None = None,
                spec_overhead_ms: float = 0.0, profile_max_c: int | None = None,
                spec_overhead_seq_ms: float = 0.0) -> dict[str, float]:
    """`predicted_*` metrics of a measured speculative run against its baseline's metrics.
    tokens_per_step: (tau, draft share) per level from elsewhere (a replay) instead of the counters."""
    method, k = draft_length(config.spec)
    verified = config.verified_per_step
    profile = baseline_profile(base, b_tok_ms, spec_overhead_ms, profile_max_c, spec_overhead_seq_ms)
    cost = DRAFT_STEP_COST.get(method, 0.0) if draft_step_cost is None else draft_step_cost
    out: dict[str, float] = {"predicted_profile_a_ms": profile.a_ms, "predicted_profile_b_seq_ms": profile.b_seq_ms}
    if b_tok_ms is not None:
        out["predicted_profile_b_tok_ms"] = b_tok_ms
    if spec_overhead_ms:
        out["predicted_profile_spec_overhead_ms"] = spec_overhead_ms
    if spec_overhead_seq_ms:
        out["predicted_profile_spec_overhead_seq_ms"] = spec_overhead_seq_ms
    for c in levels_of(option):
        if f"output_tok_s_c{c}" not in base:
            continue
        tau, share = (tokens_per_step or {}).get(c) or level_acceptance(option, c, (drafts_by_level or {}).get(c))
        phi = base.get(f"ttft_mean_ms_c{c}", 0.0) / base[f"e2e_mean_ms_c{c}"] if base.get(f"e2e_mean_ms_c{c}") else 0.0
        p = predict_level(profile, c, tau, k, share, cost, phi, base[f"output_tok_s_c{c}"], verified)
        out |= {f"predicted_output_tok_s_c{c}": p.output_tok_s, f"predicted_speedup_c{c}": p.speedup,
                f"predicted_tokens_per_step_c{c}": tau,
                f"predicted_break_even_accept_length_c{c}": p.break_even_accept_length,
                f"predicted_break_even_acceptance_rate_c{c}": min(
                    1.0, break_even_acceptance_rate(p.break_even_accept_length, k))}
        if c == min(levels_of(option)):
            out["predicted_output_tok_s"], out["predicted_speedup"] = p.output_tok_s, p.speedup
            be = break_even_concurrency(profile, tau, k, share, cost, verified=verified)
            if math.isfinite(be):
                out["predicted_break_even_concurrency"] = float(be)
    if not any(key.startswith("predicted_speedup_c") for key in out):
        raise PredictionUnavailable("option and baseline share no concurrency level")
    return out
