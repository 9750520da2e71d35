"""experiments/analysis/words.py: an option configuration in words (the match window named only where it is not the
engine's default), load levels, a workload and its prompt set, the few-prompts warning, and which settings are the
option's or the engine's defaults (read from conf/option/*.yaml and conf/engine/*.yaml)."""
from __future__ import annotations

from experiments.analysis.words import (
    MIN_PROMPTS,
    engine_window,
    few_prompts,
    levels_words,
    option_words,
    set_by_default,
    workload_words,
)
from experiments.config.views import SpecView


def test_option_words_of_each_method() -> None:
    assert option_words("A", {"method": "ngram", "num_draft_tokens": 4}) == "A: n-gram, 4 draft tokens"
    assert option_words("B", SpecView("eagle3", num_steps=1, topk=1)) == "B: EAGLE-3, 1 step"
    assert option_words("B", {"method": "eagle3", "num_steps": 3, "topk": 4}) == "B: EAGLE-3, 3 steps, top-4 tree"
    assert option_words("baseline", {"method": "none"}) == "no speculation"
    assert option_words(None, None) == "no speculation"
    assert option_words(None, {"method": "eagle3", "num_steps": 2, "moe_expert_budget": 6}) == \
        "EAGLE-3, 2 steps, expert budget 6"


def test_the_match_window_is_named_only_where_it_is_not_the_engines_default() -> None:
    default = {"method": "ngram", "num_draft_tokens": 4, "ngram": {"min_match": 2, "max_match": 4}}
    other = {"method": "ngram", "num_draft_tokens": 4, "ngram": {"min_match": 1, "max_match": 3}}
    assert engine_window("vllm") == (2, 4)
    assert option_words("A", default, "vllm") == "A: n-gram, 4 draft tokens"
    assert option_words("A", other, "vllm") == "A: n-gram, 4 draft tokens, match window 1-3"
    assert option_words("A", other, "sglang") == "A: n-gram, 4 draft tokens"   # its trie takes no window


def test_engine_window_of_an_engine_without_one_is_none() -> None:
    assert engine_window("sglang") == (None, None)
    assert engine_window("no-such-engine") == (None, None)
    assert engine_window(None) == (None, None)


def test_levels_words() -> None:
    assert levels_words([]) == "c = "
    assert levels_words([4]) == "c = 4"
    assert levels_words([1, 4]) == "c = 1 and 4"
    assert levels_words([1, 4, 8], prefix="") == "1, 4 and 8"


def test_workload_words_names_another_prompt_set() -> None:
    assert workload_words("quick", "grounded") == "quick (prompt set grounded)"
    assert workload_words("grounded", "grounded") == "grounded"
    assert workload_words(None, "grounded") == "grounded"
    assert workload_words(None) == "?"


def test_few_prompts_warns_below_the_minimum_with_the_fix() -> None:
    assert few_prompts("quick", 8) == f"too few prompts to decide on (8 per level, fewer than {MIN_PROMPTS}); " \
                                      "run workload=grounded"
    assert few_prompts("grounded", 8).endswith("raise workload.num_prompts")
    assert few_prompts("quick", MIN_PROMPTS) is None
    assert few_prompts("quick", 0) is None


def test_set_by_default_reads_the_option_and_the_engine() -> None:
    assert set_by_default("A", "vllm", "num_draft_tokens", 4) is True
    assert set_by_default("A", "vllm", "num_draft_tokens", "4") is True
    assert set_by_default("A", "vllm", "num_draft_tokens", 6) is False
    assert set_by_default("A", "vllm", "ngram.max_match", 4) is True
    assert set_by_default("A", "sglang", "ngram.max_match", 4) is False      # SGLang gives no window
    assert set_by_default("B", "vllm", "num_draft_tokens", 99) is True       # derived from num_steps in the yaml
    assert set_by_default("no-such-option", "vllm", "num_draft_tokens", 4) is False
    assert set_by_default(None, "vllm", "topk", 1) is False
