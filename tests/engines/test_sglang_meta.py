"""SGLang's per-request meta_info, release by release: each fixture is built by hand the way that release's
own source fills it, for one request with known steps, and the adapter must read the same numbers from all.

The request: speculative_num_draft_tokens = 4 (3 drafts per verification step), four verification steps that
accepted 3, 0, 1 and 3 drafts, plus the prefill's first token: completion_tokens = 1 + 4 + 1 + 2 + 4 = 12.
"""
from __future__ import annotations

import math

import pytest

from experiments.engines.sglang_engine import SGLangAdapter

DRAFT_TOKENS = 4
ACCEPTED = [3, 0, 1, 3]          # correct drafts per verification step
STEPS = len(ACCEPTED)
COMPLETION = 1 + sum(a + 1 for a in ACCEPTED)
HISTOGRAM = [1, 1, 0, 2]         # steps that accepted 0, 1, 2, 3 drafts
PROPOSED = STEPS * (DRAFT_TOKENS - 1)


def meta_0_5_2() -> dict:
    # tokenizer_manager.py, TokenizerManager._handle_batch_output: on the finishing output of a speculative
    # server only spec_verify_ct is added (Req.spec_verify_ct, counted per verification step).
    return {"completion_tokens": COMPLETION, "spec_verify_ct": STEPS}


def meta_0_5_6() -> dict:
    # tokenizer_manager.py, TokenizerManager._calculate_spec_decoding_metrics: spec_accept_token_num =
    # Req.spec_accepted_tokens (eagle_info.py / ngram_info.py verify: accepted indices - 1, the bonus excluded),
    # spec_draft_token_num = spec_verify_ct * (speculative_num_draft_tokens - 1); no histogram.
    return {"completion_tokens": COMPLETION, "spec_verify_ct": STEPS, "spec_accept_rate": sum(ACCEPTED) / PROPOSED,
            "spec_accept_length": COMPLETION / STEPS, "spec_accept_token_num": sum(ACCEPTED),
            "spec_draft_token_num": PROPOSED}


def meta_0_5_9() -> dict:
    # As 0.5.6, plus spec_accept_histogram = Req.spec_acceptance_histogram (schedule_batch.py,
    # Req.update_spec_acceptance_histogram: index = accepted draft tokens of one step).
    return {**meta_0_5_6(), "spec_accept_histogram": list(HISTOGRAM)}


def meta_0_5_14() -> dict:
    # tokenizer_manager.py, _calculate_spec_decoding_metrics: spec_num_correct_drafts (Req.spec_num_correct_drafts,
    # batch_result_processor.py), spec_num_proposed_drafts = verify_ct * (draft tokens - 1),
    # spec_correct_drafts_histogram (schedule_batch.py, Req.update_spec_correct_drafts_histogram: index = correct
    # drafts of one step), and the backward-compatible aliases spec_accepted_drafts, spec_proposed_drafts,
    # spec_accept_histogram.
    return {"completion_tokens": COMPLETION, "spec_verify_ct": STEPS, "spec_accept_rate": sum(ACCEPTED) / PROPOSED,
            "spec_accept_length": COMPLETION / STEPS, "spec_num_correct_drafts": sum(ACCEPTED),
            "spec_num_proposed_drafts": PROPOSED, "spec_accepted_drafts": sum(ACCEPTED),
            "spec_proposed_drafts": PROPOSED, "spec_correct_drafts_histogram": list(HISTOGRAM),
            "spec_accept_histogram": list(HISTOGRAM)}


def meta_0_5_23() -> dict:
    # tokenizer_manager.py, _calculate_spec_decoding_metrics: the aliases are gone; only spec_num_correct_drafts,
    # spec_num_proposed_drafts and spec_correct_drafts_histogram (same meaning as 0.5.14).
    aliases = ("spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram")
    return {k: v for k, v in meta_0_5_14().items() if k not in aliases}


RELEASES = {"0.5.2": meta_0_5_2, "0.5.6": meta_0_5_6, "0.5.9": meta_0_5_9, "0.5.14": meta_0_5_14,
            "0.5.23": meta_0_5_23}
WITH_PROPOSED = {"0.5.6", "0.5.9", "0.5.14", "0.5.23"}
WITH_HISTOGRAM = {"0.5.9", "0.5.14", "0.5.23"}


@pytest.mark.parametrize("release", list(RELEASES))
def test_request_acceptance_of_every_release(release: str) -> None:
    acc = SGLangAdapter().request_acceptance({"meta": RELEASES[release](), "error": None})
    assert (acc.steps, acc.emitted, acc.accepted) == (STEPS, COMPLETION, sum(ACCEPTED))
    assert acc.accept_length == 3.0
    if release in WITH_PROPOSED:
        assert acc.proposed == PROPOSED and acc.acceptance_rate == 7 / 12
    else:
        assert acc.proposed is None and math.isnan(acc.acceptance_rate)
    assert acc.accepted_per_position == ([3, 2, 2] if release in WITH_HISTOGRAM else None)


@pytest.mark.parametrize("release", sorted(WITH_PROPOSED))
def test_numbers_agree_with_sglangs_own(release: str) -> None:
    meta = RELEASES[release]()
    acc = SGLangAdapter().request_acceptance({"meta": meta, "error": None})
    assert acc.accept_length == meta["spec_accept_length"] and acc.acceptance_rate == meta["spec_accept_rate"]


@pytest.mark.parametrize("release", list(RELEASES))
def test_run_acceptance_of_every_release(release: str) -> None:
    second = {"completion_tokens": 5, "spec_verify_ct": 4}  # 0.5.2 shape: 0 drafts accepted in 4 steps
    acc = SGLangAdapter().acceptance(None, None, [RELEASES[release](), second, None, {}])
    assert (acc.drafts, acc.accepted_tokens) == (8, 7)
    assert acc.accept_length == (COMPLETION + 5) / 8
    if release in WITH_PROPOSED:   # the rate over the requests that say what they proposed
        assert acc.draft_tokens == PROPOSED and acc.acceptance_rate == 7 / 12
    else:
        assert acc.draft_tokens == 0 and math.isnan(acc.acceptance_rate)
    if release in WITH_HISTOGRAM:  # over the steps of the requests that carry a histogram
        assert acc.per_position == [0.75, 0.5, 0.5]
        assert acc.length_histogram == {1: 0.25, 2: 0.25, 3: 0.0, 4: 0.5}
    else:
        assert acc.per_position == [] and acc.length_histogram == {}


def test_no_speculation_or_a_failed_request_gives_none() -> None:
    adapter = SGLangAdapter()
    assert adapter.request_acceptance({"meta": {"completion_tokens": 9}, "error": None}) is None
    assert adapter.request_acceptance({"meta": meta_0_5_23(), "error": "HTTP 500"}) is None
    assert adapter.request_acceptance({"meta": None, "error": None}) is None
    assert adapter.acceptance(None, None, [{"completion_tokens": 9}]) is None
