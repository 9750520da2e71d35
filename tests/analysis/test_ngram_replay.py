"""experiments/analysis/ngram_replay.py on sequences small enough to work by hand (tests/analysis/test_replay.py
checks it against the step-by-step reference on recorded outputs): the draft vLLM's prompt lookup makes at each
step (the longest suffix match, its earliest occurrence), what is accepted, the upper bound past the recorded end,
the model-length cap, matches kept inside their request, and the counters summed and turned into metrics."""
from __future__ import annotations

import pytest

from experiments.analysis.ngram_replay import NgramConfig, NgramIndex, ReplaySequence, replay_config, total

REPEAT = ReplaySequence(prompt_ids=[1, 2, 3, 4], output_ids=[1, 2, 3, 4, 5])


def _replay(seqs: list[ReplaySequence], cfg: NgramConfig, **kw):
    return replay_config(NgramIndex(seqs, cfg.max_match), cfg, **kw)


def test_config_label() -> None:
    assert NgramConfig(2, 4, 3).label == "min2_max4_k3"


def test_a_repeated_prompt_is_drafted_in_full_on_the_first_decode_step() -> None:
    # step at [1,2,3,4 | 1]: the suffix [1] matched at 0, draft [2,3,4], all accepted, 4 tokens emitted
    (stats,) = _replay([REPEAT], NgramConfig(1, 2, 3), keep_emitted=True)
    assert (stats.steps, stats.drafts, stats.draft_tokens, stats.accepted, stats.accepted_upper) == (1, 1, 3, 3, 3)
    assert (stats.output_tokens, stats.decode_tokens, stats.per_pos) == (5, 4, [1, 1, 1])
    assert (stats.emitted, stats.verified) == ([1, 4], [3])


def test_min_match_skips_short_matches_and_a_wrong_draft_token_stops_acceptance() -> None:
    # no 2-gram match after [.. 4, 1]; after [.. 1, 2]: draft [3,4,1] against [3,4,5]: 2 accepted
    (stats,) = _replay([REPEAT], NgramConfig(2, 2, 3))
    assert (stats.steps, stats.drafts, stats.draft_tokens, stats.accepted, stats.per_pos) == (2, 1, 3, 2, [1, 1, 0])


def test_draft_tokens_past_the_recorded_end_count_only_in_the_upper_bound() -> None:
    (stats,) = _replay([ReplaySequence([1, 2, 3], [1, 2])], NgramConfig(1, 1, 3))
    assert (stats.draft_tokens, stats.accepted, stats.accepted_upper) == (3, 1, 3)


def test_no_draft_beyond_the_model_length() -> None:
    (capped,) = _replay([REPEAT], NgramConfig(1, 2, 3), max_model_len=5)
    assert (capped.steps, capped.drafts, capped.accepted) == (4, 0, 0)
    assert capped.metrics()["tokens_per_step"] == 1.0 and "accept_length" not in capped.metrics()


def test_matches_stay_inside_their_request() -> None:
    first = ReplaySequence([7, 8, 9], [7, 8, 9])
    second = ReplaySequence([5], [8, 9, 6])          # [8] occurs only in the first request
    a, b = _replay([first, second], NgramConfig(1, 2, 2))
    assert a.drafts == 1 and a.accepted == 2
    assert (b.steps, b.drafts) == (2, 0)


def test_total_and_metrics_sum_the_requests() -> None:
    stats = _replay([REPEAT, REPEAT], NgramConfig(2, 2, 3))
    agg = total(stats)
    assert (agg.steps, agg.drafts, agg.draft_tokens, agg.accepted, agg.per_pos) == (4, 2, 6, 4, [2, 2, 0])
    m = agg.metrics()
    assert m["accept_length"] == pytest.approx(3.0) and m["acceptance_rate"] == pytest.approx(4 / 6)
    assert m["tokens_per_step"] == pytest.approx(8 / 4) and m["steps_with_draft"] == pytest.approx(0.5)
    assert (m["accept_pos_0"], m["accept_pos_1"], m["accept_pos_2"]) == (1.0, 1.0, 0.0)


def test_a_request_without_output_has_no_steps() -> None:
    (stats,) = _replay([ReplaySequence([1, 2, 3], [])], NgramConfig(1, 2, 3), keep_emitted=True)
    assert (stats.steps, stats.output_tokens, stats.decode_tokens, stats.emitted) == (0, 0, 0, [])
