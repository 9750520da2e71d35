"""Per-request acceptance from vLLM's streamed chunks (its counters are per server): each chunk is one engine
step of the request, a chunk of n tokens accepted n - 1 drafts in order."""
from __future__ import annotations

import math

from experiments.engines.base import RequestAcceptance, accepted_per_position
from experiments.engines.vllm_engine import VLLMAdapter


def test_chunks_give_steps_emitted_and_positions() -> None:
    acc = VLLMAdapter().request_acceptance({"chunk_tokens": [1, 3, 1, 5, 2], "output_token_ids": [0] * 12,
                                            "meta": None, "error": None})
    assert (acc.steps, acc.emitted, acc.proposed) == (5, 12, None)
    assert acc.accepted_per_position == [3, 2, 1, 1]   # chunks of 3, 5, 2 tokens accepted 2, 4, 1 drafts
    assert acc.accepted == 7 and acc.accept_length == 12 / 5 and math.isnan(acc.acceptance_rate)


def test_a_baseline_gives_one_token_per_step_and_failures_none() -> None:
    acc = VLLMAdapter().request_acceptance({"chunk_tokens": [1, 1, 1], "meta": None, "error": None})
    assert (acc.steps, acc.emitted, acc.accepted_per_position, acc.accept_length) == (3, 3, [], 1.0)
    assert VLLMAdapter().request_acceptance({"chunk_tokens": [1, 2], "error": "HTTP 500"}) is None
    assert VLLMAdapter().request_acceptance({"chunk_tokens": [], "error": None}) is None


def test_accepted_per_position_counts_steps_accepting_at_least_i_plus_one() -> None:
    assert accepted_per_position({0: 2, 3: 1, 1: 4}) == [5, 1, 1]
    assert accepted_per_position({}) == [] and accepted_per_position({2: 0}) == []
    assert RequestAcceptance(steps=0, emitted=0).accept_length != RequestAcceptance(steps=0, emitted=0).accept_length
