"""Speedup model: sanity of the formula, break-even solutions, the box profile, inputs it refuses."""
from __future__ import annotations

import math
import random
import statistics
from functools import cache

import numpy as np
import pytest

from experiments.analysis.replay import NgramConfig, ReplaySequence
from experiments.analysis.runs import RunConfig
from experiments.analysis.speedup.fit import probe_b_tok, probe_slopes
from experiments.analysis.speedup.model import (
    BoxProfile,
    LinearProfile,
    PredictionUnavailable,
    accept_length_for_rate,
    break_even_acceptance_rate,
    break_even_concurrency,
    expected_distinct_experts,
    level_acceptance,
    load_moe_time_curve,
    predict_level,
    predict_run,
)

CPU_LIKE = LinearProfile(a_ms=30.0, b_seq_ms=4.0, b_tok_ms=0.6)


@cache
def simulated_distinct_experts(tokens: int, experts: int = 384, top_k: int = 8, trials: int = 2000) -> float:
    """Mean distinct experts when each token picks top_k distinct experts uniformly: sampled, not the formula."""
    rng = random.Random(0)
    return statistics.fmean(len({e for _ in range(tokens) for e in rng.sample(range(experts), top_k)})
                            for _ in range(trials))


@pytest.mark.parametrize("profile", [CPU_LIKE, BoxProfile()])
@pytest.mark.parametrize("c", [1, 4, 64])
def test_zero_acceptance_never_pays(profile, c) -> None:
    """One token per step with k drafts to verify: strictly slower than the baseline (draft cost or not)."""
    for cost in (0.0, 0.1):
        assert predict_level(profile, c, tau=1.0, k=4, draft_share=1.0, draft_step_cost=cost).speedup < 1.0


def test_more_acceptance_more_speedup_and_prefill_dilutes_it() -> None:
    s = [predict_level(CPU_LIKE, 1, tau, 4, 1.0, 0.0).speedup for tau in (1.5, 2.5, 3.5)]
    assert s[0] < s[1] < s[2]
    with_prefill = predict_level(CPU_LIKE, 1, 3.5, 4, 1.0, 0.0, prefill_share=0.3).speedup
    assert 1.0 < with_prefill < s[2]


def test_break_even_tokens_per_step_solves_speedup_one() -> None:
    for profile, c in ((CPU_LIKE, 1), (CPU_LIKE, 8), (BoxProfile(), 1), (BoxProfile(), 32)):
        p = predict_level(profile, c, 2.0, 4, 1.0, 0.05)
        at = predict_level(profile, c, p.break_even_tokens_per_step, 4, 1.0, 0.05).speedup
        assert at == pytest.approx(1.0, rel=1e-9)


def test_break_even_by_hand_for_the_linear_profile() -> None:
    """T(c, q) = 30 + 4c + 0.6c(q - 1); a draft step costs 0.05 T(1, 1) = 1.7 ms. At c = 8, k = 4 drafted on every
    step: (T(8, 5) + 4 * 1.7) / T(8, 1) = (81.2 + 6.8) / 62. Drafting half the steps verifies q = 3 at half the
    draft cost, (71.6 + 3.4) / 62, while the accept length (vLLM's: all k drafted) stays 88 / 62."""
    every, half = (predict_level(CPU_LIKE, 8, 2.0, 4, share, 0.05) for share in (1.0, 0.5))
    assert every.break_even_tokens_per_step == pytest.approx(88 / 62)
    assert every.break_even_accept_length == pytest.approx(88 / 62)
    assert half.break_even_tokens_per_step == pytest.approx(75 / 62)
    assert half.break_even_accept_length == pytest.approx(88 / 62)


def test_break_even_acceptance_rate_inverts_the_geometric_accept_length() -> None:
    for alpha in (0.1, 0.5, 0.83):
        assert break_even_acceptance_rate(accept_length_for_rate(alpha, 4), 4) == pytest.approx(alpha, abs=1e-9)
    assert break_even_acceptance_rate(6.0, 4) == math.inf


def test_break_even_concurrency_is_where_speedup_crosses_one() -> None:
    costly = LinearProfile(a_ms=30.0, b_seq_ms=4.0, b_tok_ms=2.0)   # a verified token costs half a sequence
    c_star = break_even_concurrency(costly, tau=2.0, k=4, draft_share=1.0, draft_step_cost=0.0)
    assert 1.0 < c_star < math.inf
    assert predict_level(costly, c_star, 2.0, 4, 1.0, 0.0).speedup == pytest.approx(1.0, abs=1e-6)
    assert predict_level(costly, c_star * 0.9, 2.0, 4, 1.0, 0.0).speedup > 1.0
    # analytic for the linear profile: tau (a + b c) = a + b c + b_tok c k
    a, b, bt = costly.a_ms, costly.b_seq_ms, costly.b_tok_ms
    assert c_star == pytest.approx(a * (2.0 - 1.0) / (bt * 4 - b * (2.0 - 1.0)), rel=1e-6)
    assert break_even_concurrency(costly, 1.0, 4, 1.0, 0.0) == 0.0          # never pays
    # cheap verification (the CPU engine's probe): tau / (1 + b_tok k / b_seq) > 1, pays at any concurrency
    assert break_even_concurrency(CPU_LIKE, 2.0, 4, 1.0, 0.0) == math.inf


def test_expected_distinct_experts_and_measured_curve() -> None:
    assert expected_distinct_experts(1, 384, 8) == pytest.approx(8.0)
    # 2000 sampled routings: standard error 0.04 experts; with-replacement picks would give 59.0 instead of 59.5
    assert expected_distinct_experts(8, 384, 8) == pytest.approx(simulated_distinct_experts(8), abs=0.25)
    assert expected_distinct_experts(10_000, 384, 8) == pytest.approx(384.0)
    uniform, skewed = BoxProfile(), BoxProfile(expert_curve=[8, 12, 15, 17, 19])
    assert skewed.distinct_experts(3) == 15
    assert skewed.distinct_experts(40) < uniform.distinct_experts(40) <= 384
    # fewer distinct experts under verification: speculation costs less on the box
    assert predict_level(skewed, 1, 2.0, 4, 1.0, 0.0).speedup > predict_level(uniform, 1, 2.0, 4, 1.0, 0.0).speedup


def test_box_profile_reproduces_the_single_stream_and_plateau_it_was_given() -> None:
    box = BoxProfile()
    assert box.step_ms(1, 1) == pytest.approx(1000 / 82.5)
    parts = box.components_ms(1, 1)
    assert parts["allreduce"] / box.step_ms(1, 1) == pytest.approx(0.515)
    plateau = 128 * 1000 / box.step_ms(128, 1)
    assert plateau == pytest.approx(1536, rel=0.10)   # components, not a fit, land within 10 %
    # verifying 5 tokens per sequence grows AllReduce volume and distinct experts
    more = box.components_ms(1, 5)
    assert more["allreduce"] > parts["allreduce"] and more["gemm"] > parts["gemm"]


def test_linear_profile_fit_and_refusals() -> None:
    prof = LinearProfile.from_levels({1: 34.0, 4: 46.0, 16: 94.0})
    assert prof.a_ms == pytest.approx(30.0) and prof.b_seq_ms == pytest.approx(4.0)
    with pytest.raises(PredictionUnavailable):
        LinearProfile.from_levels({})
    base = {"output_tok_s_c1": 29.0, "tpot_mean_ms_c1": 34.0, "e2e_mean_ms_c1": 4000.0, "ttft_mean_ms_c1": 80.0}
    with pytest.raises(PredictionUnavailable, match="no speculation"):
        predict_run({"output_tok_s_c1": 30.0}, RunConfig.from_params({"spec.method": "none"}), base)
    with pytest.raises(PredictionUnavailable, match="no acceptance"):
        predict_run({"output_tok_s_c1": 30.0, "output_tokens_c1": 100, "requests_c1": 2},
                    RunConfig.from_params({"spec.method": "ngram", "spec.num_draft_tokens": "4"}), base)


def test_level_acceptance_from_counters() -> None:
    # 10 requests, 1010 tokens: 1000 decode tokens; 200 drafted steps accept 3.5 tokens each = 700 tokens,
    # the other 300 tokens come one per step -> 500 steps, 2 tokens per step, 40 % of steps drafted
    m = {"output_tokens_c1": 1010.0, "requests_c1": 10.0, "accept_length_c1": 3.5,
         "tokens_per_chunk_c1": 1010 / 510, "steps_with_draft_c1": 200 / 510}
    tau, share = level_acceptance(m, 1)
    assert tau == pytest.approx(2.0) and share == pytest.approx(0.4)


def test_probe_recovers_a_known_verification_cost() -> None:
    """Chunk times built from a step-time law t = 30 ms + 0.7 ms per verified draft token on sequences the
    replay solves: the probe returns the slope it was built with."""
    rng = np.random.default_rng(1)
    cfg = NgramConfig(2, 4, 4)
    from experiments.analysis.replay import NgramIndex, replay_config
    seqs = []
    for i in range(6):
        prompt = rng.integers(0, 50, 80).tolist()
        seqs.append(ReplaySequence(prompt, prompt[5:45] + rng.integers(0, 50, 20).tolist(), f"p{i}", 1))
    stats = replay_config(NgramIndex(seqs, cfg.max_match), cfg, keep_emitted=True)
    for seq, st in zip(seqs, stats, strict=True):
        seq.chunk_tokens = st.emitted
        seq.chunk_times_s = np.concatenate([[0.05], 0.05 + np.cumsum(
            (30.0 + 0.7 * np.asarray(st.verified) + rng.normal(0, 0.05, len(st.verified))) / 1000)]).tolist()
    slopes = probe_slopes({"run": (seqs, cfg)})
    assert slopes["run"] == pytest.approx(0.7, abs=0.05)
    assert probe_b_tok(slopes, exclude="run") is None


def test_sglang_verified_tokens_follow_sglangs_topk1_rule() -> None:
    """SGLang verifies num_steps + 1 tokens for EAGLE-3 with topk 1 whatever num_draft_tokens says (stored runs
    were launched with 4 at 1-5 steps); n-gram and topk > 1 verify num_draft_tokens; vLLM: None."""
    def sglang_verified_per_step(params: dict[str, str]) -> float | None:
        return RunConfig.from_params(params).verified_per_step

    eagle = {"engine.name": "sglang", "spec.method": "eagle3", "spec.num_draft_tokens": "4"}
    assert [sglang_verified_per_step({**eagle, "spec.topk": "1", "spec.num_steps": str(n)})
            for n in (1, 3, 5)] == [2.0, 4.0, 6.0]
    assert sglang_verified_per_step({**eagle, "spec.topk": "4", "spec.num_steps": "5",
                                     "spec.num_draft_tokens": "8"}) == 8.0
    assert sglang_verified_per_step({"engine.name": "sglang", "spec.method": "ngram",
                                     "spec.num_draft_tokens": "8"}) == 8.0
    assert sglang_verified_per_step({**eagle, "engine.name": "vllm", "spec.topk": "1", "spec.num_steps": "3"}) is None


def test_a_measured_moe_kernel_curve_replaces_the_distinct_expert_proportion(tmp_path) -> None:
    """The kernel microbenchmark's JSON shape: MoE time per (N, M, routing); the box's MoE term follows the
    measured time at the TP-8 shard, interpolated in tokens and held past the last point."""
    rows = {f"N={n} M={m} uniform": {"N": n, "M": m, "routing": "uniform", "marlin_w4a16": {"us": us}}
            for n, m, us in [(256, 1, 40.0), (256, 8, 80.0), (256, 64, 320.0), (2048, 1, 100.0)]}
    rows["N=256 M=8 skew0.25"] = {"N": 256, "M": 8, "routing": "skew0.25", "marlin_w4a16": {"us": 999.0}}
    path = tmp_path / "kernels.json"
    path.write_text(__import__("json").dumps({"rows": rows}))
    curve = load_moe_time_curve(path)
    assert curve == [(1.0, 1.0), (8.0, 2.0), (64.0, 8.0)]
    box, measured = BoxProfile(), BoxProfile(moe_time_curve=curve)
    assert measured.moe_growth(1) == 1.0 and measured.moe_growth(36) == pytest.approx(5.0)
    assert measured.moe_growth(500) == 8.0
    assert box.moe_growth(8) == pytest.approx(simulated_distinct_experts(8) / 8, abs=0.03)
    share = measured.share_moe * measured.t1_ms
    assert measured.components_ms(1, 8)["gemm"] == pytest.approx(measured.share_dense * measured.t1_ms + 2 * share)
    with pytest.raises(PredictionUnavailable, match="N=128"):
        load_moe_time_curve(path, n=128)
