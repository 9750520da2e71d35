"""Acceptance from vLLM's Prometheus counters and SGLang's meta_info, per window and per run."""
from __future__ import annotations

import pytest

from experiments.engines.base import acceptance_from_positions, merge_acceptance
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter

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
