"""experiments/engines/head_layout.py directly (tests/engines/test_head_layout.py reads it through the adapters):
the layout per engine name, the refusal of an engine without one, the ids shifted per engine and their convention."""
from __future__ import annotations

import pytest

from experiments.engines.head_layout import HEAD_LAYOUTS, head_layout


def test_head_layout_by_engine_name() -> None:
    assert head_layout("vllm") is HEAD_LAYOUTS["vllm"]
    assert head_layout("sglang").aux_id_offset == 1


def test_an_engine_without_a_layout_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no EAGLE-3 head layout for engine 'trtllm'; known: \['sglang', 'vllm'\]"):
        head_layout("trtllm")


def test_aux_layer_ids_accept_lists_and_text_digits() -> None:
    assert head_layout("sglang").aux_layer_ids([1, "15", 27]) == [0, 14, 26]
    assert head_layout("vllm").aux_layer_ids([0, 1]) == [0, 1]     # vLLM can name the embeddings (id 0)


def test_convention_names_engine_and_meaning() -> None:
    assert head_layout("sglang").convention == "sglang: id k = output of target layer k"
    assert head_layout("vllm").convention == "vllm: id k = input of target layer k (hidden_states[k])"


def test_aux_layer_ids_refuse_an_empty_list_by_name() -> None:
    with pytest.raises(ValueError, match=r"^no aux layer ids given for sglang: an EAGLE-3 head needs at least one$"):
        head_layout("sglang").aux_layer_ids([])
