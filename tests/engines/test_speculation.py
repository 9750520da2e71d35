"""experiments/engines/speculation.py: each engine's drafting rules as the analysis reads them -- the n-gram replay
window (and the error for a run that left its window unset), the tokens a SGLang step verifies, the CUDA-graph batch
limit among SGLang's arguments, and which rules `speculation_of` gives each engine."""
from __future__ import annotations

import pytest

from experiments.config.views import SpecView
from experiments.engines.speculation import NgramWindow, SGLangSpeculation, Speculation, VLLMSpeculation, speculation_of


def test_speculation_of_gives_each_engine_its_rules_and_unknown_engines_the_plain_ones() -> None:
    assert type(speculation_of("vllm")) is VLLMSpeculation
    assert type(speculation_of("sglang")) is SGLangSpeculation
    plain = speculation_of("no-such-engine")
    assert type(plain) is Speculation
    assert plain.ngram_window(SpecView("ngram", num_draft_tokens=4)) is None


def test_vllm_ngram_window_is_exact_prompt_lookup() -> None:
    spec = SpecView("ngram", num_draft_tokens=4, ngram={"min_match": 2, "max_match": 5})
    assert VLLMSpeculation().ngram_window(spec) == NgramWindow(2, 5, 4, exact=True, prompt_tail=None)
    assert VLLMSpeculation().ngram_window(SpecView("eagle3", num_steps=3)) is None


def test_vllm_ngram_window_names_every_unset_setting() -> None:
    with pytest.raises(ValueError, match=r"^spec.ngram.max_match, spec.num_draft_tokens not set$"):
        VLLMSpeculation().ngram_window(SpecView("ngram", ngram={"min_match": 2}))


def test_vllm_overhead_terms_are_one_for_every_drafter() -> None:
    assert VLLMSpeculation().overhead_terms("eagle3") == "vllm"
    assert SGLangSpeculation().overhead_terms("eagle3") == "eagle3"


def test_sglang_verified_per_step() -> None:
    sg = SGLangSpeculation()
    assert sg.verified_per_step(SpecView("none")) is None
    assert sg.verified_per_step(SpecView("eagle3", num_steps=3, topk=1, num_draft_tokens=8)) == 4.0
    assert sg.verified_per_step(SpecView("eagle3", num_steps=3, topk=4, num_draft_tokens=8)) == 8.0
    assert sg.verified_per_step(SpecView("ngram", num_draft_tokens=6)) == 6.0
    assert sg.verified_per_step(SpecView("eagle3", num_steps=2, topk=4)) == 3.0


def test_sglang_ngram_window_is_a_lower_bound_over_the_prompt_tail() -> None:
    sg = SGLangSpeculation()
    assert sg.ngram_window(SpecView("ngram", num_draft_tokens=8)) == \
        NgramWindow(1, 18, 7, exact=False, prompt_tail=18)
    assert sg.ngram_window(SpecView("ngram", num_draft_tokens=1, ngram={"max_trie_depth": 6})) == \
        NgramWindow(1, 6, 1, exact=False, prompt_tail=6)
    with pytest.raises(ValueError, match="spec.num_draft_tokens not set"):
        sg.ngram_window(SpecView("ngram"))


def test_sglang_graph_batch_limit_reads_the_decode_flag_first() -> None:
    sg = SGLangSpeculation()
    assert sg.graph_batch_limit(["--cuda-graph-max-bs", "64", "--cuda-graph-max-bs-decode", "32"]) == 32
    assert sg.graph_batch_limit(["--tp", "8", "--cuda-graph-max-bs", "64"]) == 64
    assert sg.graph_batch_limit(["--cuda-graph-max-bs"]) is None          # a flag without its value
    assert sg.graph_batch_limit(["--cuda-graph-max-bs", "many"]) is None
    assert VLLMSpeculation().graph_batch_limit(["--cuda-graph-max-bs", "64"]) is None


def test_sglang_graph_batch_limit_reads_the_equals_form() -> None:
    sg = SGLangSpeculation()
    assert sg.graph_batch_limit(["--tp", "8", "--cuda-graph-max-bs=64"]) == 64
    assert sg.graph_batch_limit(["--cuda-graph-max-bs=64", "--cuda-graph-max-bs-decode=32"]) == 32
    assert sg.graph_batch_limit(["--cuda-graph-max-bs-decode=32", "--cuda-graph-max-bs", "64"]) == 32
    assert sg.graph_batch_limit(["--cuda-graph-max-bs="]) is None
    assert sg.graph_batch_limit(["--cuda-graph-max-bs=many"]) is None
