"""Paired bootstrap over prompts: known cases, verdicts, prompts to decide, determinism."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.analysis.stats import (
    HOST_SENSITIVE,
    LOSES,
    PAYS,
    Interval,
    block_speedups,
    blocked_speedup,
    mean_interval,
    paired_speedup,
    prompt_totals,
    prompts_to_decide,
    ratio_interval,
    verdict,
    verdict_over_blocks,
)


def prompts(n: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """n prompts of very different lengths at about 100 tok/s, each with its own small jitter."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 400, n).astype(float)
    return {f"p{i}": (t, t / (100.0 * rng.lognormal(0.0, 0.05))) for i, t in enumerate(tokens)}


def scaled(runs: dict[str, tuple[float, float]], speed: float, noise: float = 0.0, seed: int = 1):
    rng = np.random.default_rng(seed)
    return {k: (t, s / speed * rng.lognormal(0.0, noise)) for k, (t, s) in runs.items()}


def test_identical_runs_give_an_interval_around_one() -> None:
    base = prompts(30)
    iv = paired_speedup(base, dict(base))
    assert iv.estimate == pytest.approx(1.0) and iv.low == pytest.approx(1.0) and iv.high == pytest.approx(1.0)
    assert iv.n == 30 and "paired" in iv.method
    assert verdict(iv) == "inconclusive" and prompts_to_decide(iv) is None


def test_pairing_removes_prompt_to_prompt_spread() -> None:
    """Prompts of 20-400 tokens: an unpaired draw would swing the ratio; paired, only the 2 % jitter counts."""
    base = prompts(20)
    iv = paired_speedup(scaled(base, 2.0, noise=0.02), base)
    assert verdict(iv) == "pays" and iv.low < iv.estimate < iv.high
    assert iv.estimate == pytest.approx(2.0, rel=0.03) and iv.high - iv.low < 0.1


def test_clear_slowdown_does_not_pay_and_noise_is_inconclusive() -> None:
    base = prompts(20)
    assert verdict(paired_speedup(scaled(base, 0.7, noise=0.02), base)) == "does not pay"
    noisy = paired_speedup(scaled(base, 1.02, noise=0.3), base)
    assert verdict(noisy) == "inconclusive" and noisy.low < 1.0 < noisy.high


def test_only_common_prompts_count() -> None:
    base = prompts(12)
    option = {k: v for k, v in scaled(base, 1.5).items() if k not in ("p0", "p1")} | {"extra": (10.0, 1.0)}
    iv = paired_speedup(option, base)
    assert iv.n == 10 and iv.estimate == pytest.approx(1.5)
    empty = paired_speedup({"a": (1.0, 1.0)}, {"b": (1.0, 1.0)})
    assert empty.n == 0 and np.isnan(empty.estimate) and verdict(empty) == "inconclusive"


def test_deterministic_for_a_seed() -> None:
    base = prompts(15)
    option = scaled(base, 1.1, noise=0.2)
    assert paired_speedup(option, base, seed=3) == paired_speedup(option, base, seed=3)
    assert paired_speedup(option, base, seed=3) != paired_speedup(option, base, seed=4)


def test_prompts_to_decide() -> None:
    # half-width 0.1 on the side facing 1 at n = 10, estimate 1.05: (0.1 / 0.05)^2 * 10 = 40 prompts
    assert prompts_to_decide(Interval(1.05, 0.95, 1.15, 10, "t")) == 40
    assert prompts_to_decide(Interval(0.9, 0.7, 1.2, 10, "t")) == pytest.approx(10 * (0.3 / 0.1) ** 2)
    assert prompts_to_decide(Interval(1.3, 1.1, 1.5, 10, "t")) is None       # decided
    assert prompts_to_decide(Interval(1.0, 0.9, 1.1, 10, "t")) is None       # never, if the estimate holds
    # the prediction holds: a sample of that size from the same population decides it
    base = prompts(400, seed=5)
    small = dict(list(base.items())[:12])
    option = scaled(base, 1.06, noise=0.15, seed=6)
    iv = paired_speedup({k: option[k] for k in small}, small)
    needed = prompts_to_decide(iv)
    assert verdict(iv) == "inconclusive" and needed is not None and 12 < needed < 400
    big = paired_speedup(option, base)
    assert verdict(big) == "pays"


def test_mean_and_ratio_intervals() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 0.5, 200)
    iv = mean_interval(values)
    assert iv.low < 3.0 < iv.high and iv.estimate == pytest.approx(values.mean()) and iv.n == 200
    # accept length weighted by steps: 100 tokens in 50 steps and 10 tokens in 10 steps -> 110 / 60
    assert ratio_interval([100, 10], [50, 10]).estimate == pytest.approx(110 / 60)


def test_prompt_totals_cluster_a_prompt_and_skip_failures() -> None:
    recs = [{"prompt_id": "a", "output_token_ids": [1] * 10, "e2e_s": 1.0},
            {"prompt_id": "a", "turn": 1, "output_token_ids": [1] * 5, "e2e_s": 0.5},
            {"prompt_id": "b", "output_token_ids": [1] * 7, "e2e_s": 0.7},
            {"prompt_id": "c", "output_token_ids": [], "e2e_s": None, "error": "HTTP 500"}]
    assert prompt_totals(recs) == {"a": (15.0, 1.5), "b": (7.0, 0.7)}


def _arms(block_ratios: list[float], per_block: int = 16, seed: int = 0):
    """Option and baseline totals per prompt: the baseline at 100 tok/s with a prompt-to-prompt spread, the
    option at `ratio` times it in each block."""
    rng = np.random.default_rng(seed)
    option, baseline, blocks = {}, {}, {}
    for g, ratio in enumerate(block_ratios):
        for i in range(per_block):
            key, tokens = f"b{g}p{i}", 64.0
            seconds = tokens / 100.0 * rng.uniform(0.8, 1.2)
            baseline[key] = (tokens, seconds)
            option[key] = (tokens, seconds / ratio * rng.uniform(0.97, 1.03))
            blocks[key] = g
    return option, baseline, blocks


def test_the_blocked_interval_covers_what_varies_between_blocks():
    option, baseline, blocks = _arms([1.05, 1.30, 1.10, 1.35])
    prompts_only = paired_speedup(option, baseline)
    both = blocked_speedup(option, baseline, blocks)
    assert both.estimate == pytest.approx(prompts_only.estimate)
    assert (both.high - both.low) > 2 * (prompts_only.high - prompts_only.low)
    assert "4 blocks" in both.method


def test_one_block_is_the_prompt_interval():
    option, baseline, blocks = _arms([1.2])
    assert blocked_speedup(option, baseline, blocks) == paired_speedup(option, baseline)


def test_blocks_that_decide_opposite_ways_are_host_sensitive():
    option, baseline, blocks = _arms([1.3, 0.7, 1.3, 0.7])
    per_block = block_speedups(option, baseline, blocks)
    assert {verdict(iv) for iv in per_block.values()} == {PAYS, LOSES}
    assert verdict_over_blocks(blocked_speedup(option, baseline, blocks), per_block) == HOST_SENSITIVE
    steady = _arms([1.3, 1.25, 1.35, 1.3])
    per_block = block_speedups(*steady)
    assert verdict_over_blocks(blocked_speedup(*steady), per_block) == PAYS
