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

`python -m experiments.analysis.speedup.model table [--experiment E] [--log]`: predicted vs measured over every measured
run of a store (experiments/analysis/speedup/fit.py, which also holds the verification-cost probe and the hook
experiments/harness/measure.py calls).
`python -m experiments.analysis.speedup.model box --tokens-per-step 2.4 --k 4 [--expert-curve curve.json]`.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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
    experts: int = 384
    top_k: int = 8
    hidden: int = 7168
    layers: int = 61
    allreduces_per_layer: int = 2
    allreduce_bytes: int = 2                 # bf16 activations
    gpus: int = 8
    bus_gbps: float = 25.0                   # effective PCIe all-reduce bus bandwidth
    active_params: float = 32e9              # parameters a token passes through (Kimi-K2: 32 B activated)
    gpu_tflops: float = 200.0                # effective GEMM throughput per GPU (W4A16 kernels, SM120)
    expert_curve: list[float] | None = None  # measured distinct experts per layer at 1, 2, ... tokens
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
            "gemm": max(self.share_dense * t1 + self.share_moe * t1 * self.distinct_experts(n)
                        / self.distinct_experts(1), self.gemm_compute_ms_per_token() * n),
            "other": rest * t1,
        }

    def gemm_compute_ms_per_token(self) -> float:
        return 2.0 * self.active_params / (self.gpus * self.gpu_tflops * 1e12) * 1e3

    def step_ms(self, c: float, q: float) -> float:
        return sum(self.components_ms(c, q).values())


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


def sglang_verified_per_step(params: dict[str, str]) -> float | None:
    """Tokens SGLang verifies per decode step: its whole draft tree, `--speculative-num-draft-tokens` including
    the root (NGRAM pads every request's tree to that size, ngram_worker.py asserts bs * draft_token_num;
    EAGLE-3 with topk 1: num_steps + 1). None for other engines (vLLM: 1 + drafted tokens)."""
    if params.get("engine.name") != "sglang" or params.get("spec.method", "none") == "none":
        return None
    if params.get("spec.method") == "eagle3" and str(params.get("spec.topk")) == "1":
        try:   # SGLang sets num_draft_tokens = num_steps + 1 whatever was passed (arg_groups/speculative_hook.py)
            return float(int(params["spec.num_steps"]) + 1)
        except (KeyError, ValueError, TypeError):
            pass
    try:
        return float(int(params["spec.num_draft_tokens"]))
    except (KeyError, ValueError, TypeError):   # TypeError: None from a live config
        try:
            return float(int(params["spec.num_steps"]) + 1)
        except (KeyError, ValueError, TypeError):
            return None


def draft_length(params: dict[str, str]) -> tuple[str, int]:
    method = params.get("spec.method", "none")
    key = {"ngram": "spec.num_draft_tokens", "eagle3": "spec.num_steps"}.get(method)
    if key is None:
        raise PredictionUnavailable(f"no speculation to predict (spec.method={method})")
    try:
        return method, int(params[key])
    except (KeyError, ValueError) as exc:
        raise PredictionUnavailable(f"{key} not set") from exc


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


def predict_run(option: dict[str, float], params: dict[str, str], base: dict[str, float],
                drafts_by_level: dict[int, float] | None = None,
                tokens_per_step: dict[int, tuple[float, float]] | None = None,
                draft_step_cost: float | None = None, b_tok_ms: float | None = None,
                spec_overhead_ms: float = 0.0, profile_max_c: int | None = None,
                spec_overhead_seq_ms: float = 0.0) -> dict[str, float]:
    """`predicted_*` metrics of a measured speculative run against its baseline's metrics.
    tokens_per_step: (tau, draft share) per level from elsewhere (a replay) instead of the counters."""
    method, k = draft_length(params)
    verified = sglang_verified_per_step(params)
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


def main(argv: list[str] | None = None) -> None:
    from experiments.config.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.speedup.model")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="predicted vs measured tok/s over every measured run")
    t.add_argument("--experiment", default="smollm2_135m@local")
    t.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    t.add_argument("--no-replay", action="store_true", help="acceptance from engine counters only")
    t.add_argument("--no-probe", action="store_true", help="extra verified tokens cost as much as extra sequences")
    t.add_argument("--log", action="store_true", help="write predicted_* onto the runs (backfill)")
    b = sub.add_parser("box", help="predictions for Kimi-K2.5 on the Blackwell box")
    b.add_argument("--tokens-per-step", type=float, nargs="+", default=[1.5, 2.0, 2.5, 3.0, 3.5])
    b.add_argument("--k", type=int, default=4)
    b.add_argument("--draft-step-cost", type=float, default=0.0)
    b.add_argument("--expert-curve", type=Path, default=None,
                   help="JSON list (distinct experts at 1, 2, ... tokens) or experiments/moe/expert_growth.json")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    args = ap.parse_args(argv)
    if args.cmd == "table":
        import mlflow
        from mlflow.tracking import MlflowClient
        mlflow.set_tracking_uri(args.tracking_uri)
        from experiments.analysis.speedup.fit import error_table
        rows = error_table(MlflowClient(), args.experiment, not args.no_replay, not args.no_probe, args.log)
        print("| run | option | workload | k | c | acceptance | tokens/step | b_tok ms | spec overhead ms | "
              "baseline tok/s | measured tok/s | predicted tok/s | error | flag |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        ok = [r for r in rows if "error" not in r]
        for r in ok:
            print(f"| {r['run'][:8]} | {r['option']} {r['method']} | {r['workload']} | {r['k']} | {r['concurrency']} | "
                  f"{r['acceptance_source']} | {r['tokens_per_step']:.2f} | "
                  f"{'-' if r['b_tok_ms'] is None else format(r['b_tok_ms'], '.3f')} | "
                  f"{r.get('spec_overhead_ms') or 0:.3f} | {r['baseline_tok_s']:.1f} | "
                  f"{r['measured_tok_s']:.1f} | {r['predicted_tok_s']:.1f} | {100 * r['rel_error']:.1f} % | "
                  f"{r.get('flag') or ''} |")
        for label, sel in (("all", ok), ("unflagged", [r for r in ok if not r.get("flag")])):
            errs = np.array([r["rel_error"] for r in sel])
            if len(errs):
                print(f"\n{label}: {len(errs)} configurations: mean error {100 * errs.mean():.1f} %, median "
                      f"{100 * np.median(errs):.1f} %, max {100 * errs.max():.1f} %, within 15 %: "
                      f"{int((errs <= 0.15).sum())}/{len(errs)}")
        for note in dict.fromkeys(f"{r['run'][:8]}: {r['note']}" for r in ok if r.get("note")):
            print(f"inputs {note}")
        for r in rows:
            if "error" in r:
                print(f"not predicted: {r['run'][:8]}: {r['error']}")
        return
    curve = load_expert_curve(args.expert_curve, BoxProfile.experts, BoxProfile.top_k) if args.expert_curve else None
    box = BoxProfile(expert_curve=curve)
    base128 = box.step_ms(box.plateau_concurrency, 1.0)
    print(f"box profile: single stream {box.t1_ms:.2f} ms/step; at c={box.plateau_concurrency} the components give "
          f"{base128:.1f} ms/step = {box.plateau_concurrency * 1000 / base128:.0f} tok/s (measured plateau "
          f"{box.plateau_tok_s:.0f}); attention growth {box.attention_growth:.4f}/seq; AllReduce "
          f"{box.allreduce_ms_per_token():.4f} ms and GEMM FLOPs {box.gemm_compute_ms_per_token():.4f} ms per token")
    print("| tokens/step | " + " | ".join(f"c={c}" for c in args.concurrency) + " | break-even c |")
    print("|---" * (len(args.concurrency) + 2) + "|")
    for tau in args.tokens_per_step:
        cells = [predict_level(box, c, tau, args.k, 1.0, args.draft_step_cost).speedup for c in args.concurrency]
        be = break_even_concurrency(box, tau, args.k, 1.0, args.draft_step_cost)
        print(f"| {tau:.2f} | " + " | ".join(f"{x:.2f}x" for x in cells) + f" | {be:.0f} |")
    print(f"break-even tokens per step (all steps drafted, k={args.k}): " + ", ".join(
        f"c={c}: {predict_level(box, c, 1.0, args.k, 1.0, args.draft_step_cost).break_even_accept_length:.2f}"
        for c in args.concurrency))


if __name__ == "__main__":
    main()
