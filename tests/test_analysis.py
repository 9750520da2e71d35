"""Acceptance from vLLM's Prometheus counters, and the greedy losslessness classification."""
from __future__ import annotations

import pytest

from experiments.engines.base import acceptance_from_positions, merge_acceptance
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.baseline import compare_greedy, speedups

LABELS = 'engine="0",model_name="m"'


def metrics_text(drafts: float, draft_tokens: float, accepted: float, per_pos: list[float]) -> str:
    """The exposition format vLLM 0.32 serves on /metrics (counter families with _total samples)."""
    lines = []
    for name, value in [("num_drafts", drafts), ("num_draft_tokens", draft_tokens),
                        ("num_accepted_tokens", accepted)]:
        lines += [f"# TYPE vllm:spec_decode_{name} counter", f"vllm:spec_decode_{name}_total{{{LABELS}}} {value}",
                  f"vllm:spec_decode_{name}_created{{{LABELS}}} 1.7e9"]
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
    for i, v in enumerate(per_pos):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{LABELS},position="{i}"}} {v}')
    return "\n".join(lines) + "\n"


def test_vllm_acceptance_is_the_delta_over_the_window() -> None:
    adapter = VLLMAdapter()
    before = adapter.metrics_snapshot(metrics_text(10, 40, 20, [8, 6, 4, 2]))
    after = adapter.metrics_snapshot(metrics_text(110, 440, 270, [98, 80, 60, 32]))
    acc = adapter.acceptance(before, after, [])
    assert acc.drafts == 100 and acc.draft_tokens == 400 and acc.accepted_tokens == 250
    assert acc.accept_length == pytest.approx(3.5)
    assert acc.acceptance_rate == pytest.approx(0.625)
    assert acc.per_position == pytest.approx([0.90, 0.74, 0.56, 0.30])
    # steps emitting exactly n tokens: 1 -> 10 %, 2 -> 16 %, 3 -> 18 %, 4 -> 26 %, 5 -> 30 %
    assert acc.length_histogram == pytest.approx({1: 0.10, 2: 0.16, 3: 0.18, 4: 0.26, 5: 0.30})
    assert sum(n * p for n, p in acc.length_histogram.items()) == pytest.approx(acc.accept_length)


def test_run_acceptance_is_the_sum_of_its_levels_not_the_window_between() -> None:
    """The run's figure adds the levels' counter deltas: a warm-up batch served between two levels (counters
    moved 500 drafts in between here) does not count."""
    adapter = VLLMAdapter()
    snaps = [adapter.metrics_snapshot(metrics_text(*c)) for c in [
        (10, 40, 20, [8, 6, 4, 2]), (110, 440, 270, [98, 80, 60, 32]),          # level c1: its window
        (610, 2440, 270, [98, 80, 60, 32]),                                      # warm-up batch: all rejected
        (710, 2840, 320, [128, 98, 66, 38])]]                                    # level c4: its window
    c1, c4 = adapter.acceptance(snaps[0], snaps[1], []), adapter.acceptance(snaps[2], snaps[3], [])
    run = merge_acceptance([c1, c4, None])
    whole = acceptance_from_positions(200, 800, 300, [90 + 30, 74 + 18, 56 + 6, 30 + 6])
    for field in ("drafts", "draft_tokens", "accepted_tokens"):
        assert getattr(run, field) == getattr(whole, field)
    assert run.accept_length == pytest.approx(whole.accept_length) == pytest.approx(2.5)
    assert run.per_position == pytest.approx(whole.per_position)
    assert run.length_histogram == pytest.approx(whole.length_histogram)
    assert adapter.acceptance(snaps[0], snaps[3], []).accept_length < 1.5   # the window would count the warm-up
    assert merge_acceptance([None]) is None


def test_no_drafts_means_no_acceptance() -> None:
    assert acceptance_from_positions(0, 0, 0, []) is None
    adapter = VLLMAdapter()
    snap = adapter.metrics_snapshot("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")
    assert adapter.acceptance(snap, snap, []) is None


def test_sglang_accept_length_from_meta_info() -> None:
    metas = [{"completion_tokens": 120, "spec_verify_ct": 40}, {"completion_tokens": 60, "spec_verify_ct": 30},
             {"completion_tokens": 10}]
    acc = SGLangAdapter().acceptance(None, None, metas)
    assert acc.accept_length == pytest.approx(180 / 70)
    # the first token of each request comes from the prefill, not from a verification step: 79 + 29 drafts
    assert acc.accepted_tokens == (120 - 1 - 40) + (60 - 1 - 30)


def test_speedups_per_concurrency() -> None:
    option = {"output_tok_s": 120.0, "output_tok_s_c1": 120.0, "output_tok_s_c4": 200.0}
    base = {"output_tok_s": 40.0, "output_tok_s_c1": 40.0, "output_tok_s_c4": 160.0}
    assert speedups(option, base) == pytest.approx(
        {"speedup_vs_baseline": 3.0, "speedup_vs_baseline_c1": 3.0, "speedup_vs_baseline_c4": 1.25})


def rec(pid: str, out: list[int], conc: int = 1) -> dict:
    return {"prompt_id": pid, "concurrency": conc, "repetition": 0, "prompt_token_ids": [1, 2],
            "output_token_ids": out, "error": None}


def test_greedy_check_tells_near_tie_from_divergence() -> None:
    baseline = [rec("same", [5, 6, 7]), rec("tie", [5, 6, 7, 8]), rec("bug", [5, 6, 7, 8]),
                rec("short", [5, 6])]
    option = [rec("same", [5, 6, 7]), rec("tie", [5, 6, 9, 9]), rec("bug", [5, 3, 3, 3]),
              rec("short", [5, 6, 2])]
    asked = []

    def topk(ids: list[int]) -> list[tuple[int, float]]:
        asked.append(ids)
        if ids == [1, 2, 5, 6]:   # three-way bf16 tie: 4, 7 and 9 within a step of each other
            return [(4, -1.05), (9, -1.10), (7, -1.10), (8, -4.0)]
        return [(6, -0.01), (3, -5.0)]  # 6 clearly best: 3 was a real divergence

    metrics, rows = compare_greedy(option, baseline, topk, margin=0.1)
    kinds = {r["prompt_id"]: r["kind"] for r in rows}
    assert kinds == {"same": "identical", "tie": "near_tie", "bug": "divergence", "short": "length"}
    assert metrics["greedy_exact_match"] == pytest.approx(0.25)
    assert metrics["greedy_near_ties"] == 1 and metrics["greedy_real_divergences"] == 1
    assert metrics["greedy_first_divergence_min"] == 1
    assert [1, 2, 5, 6] in asked and [1, 2, 5] in asked


def test_a_wide_gap_is_never_a_near_tie() -> None:
    metrics, rows = compare_greedy([rec("p", [9])], [rec("p", [7])],
                                   lambda ids: [(7, -0.1), (9, -3.0)], margin=0.1)
    assert rows[0]["kind"] == "divergence" and rows[0]["tie_gap"] == pytest.approx(2.9)
    _, rows = compare_greedy([rec("p", [9])], [rec("p", [7])], lambda ids: [(7, -0.1), (5, -0.1)], margin=0.1)
    assert rows[0]["kind"] == "divergence" and rows[0]["tie_gap"] == float("inf")  # 9 not even in the top-k
