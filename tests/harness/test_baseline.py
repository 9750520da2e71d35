"""Speedups against the paired baseline, per concurrency, and the greedy losslessness classification."""
from __future__ import annotations

import pytest

from experiments.harness.baseline import compare_greedy, speedups


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
