"""The fields of an EAGLE-3 head's config.json that the workspace or an engine reads, checked before anything starts:
a missing field, or one of the wrong type, is refused naming the file and the field (an engine would otherwise fail
at load, or take a default: a head without hidden_size loads as 4096 wide)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from experiments.config.errors import Refused

# what vLLM's and SGLang's llama_eagle3 build the head from (transformers' LlamaConfig has a default for each)
REQUIRED_TO_LOAD = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rms_norm_eps")
AUX_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: object) -> bool:
    return _integer(value) and value > 0


def _positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _layer_ids(value: object) -> bool:
    return isinstance(value, list) and all(_integer(i) and i >= 0 for i in value)


# field (dotted inside eagle_config) -> (accepts, what it must be)
KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "architectures": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(a, str) for a in v),
                      "a non-empty list of class names"),
    "hidden_size": (_positive_int, "a positive integer"),
    "target_hidden_size": (_positive_int, "a positive integer"),
    "intermediate_size": (_positive_int, "a positive integer"),
    "num_attention_heads": (_positive_int, "a positive integer"),
    "num_key_value_heads": (_positive_int, "a positive integer"),
    "num_hidden_layers": (_positive_int, "a positive integer"),
    "head_dim": (_positive_int, "a positive integer"),
    "vocab_size": (_positive_int, "a positive integer"),
    "draft_vocab_size": (lambda v: v is None or _positive_int(v), "a positive integer or null (the target's)"),
    "max_position_embeddings": (_positive_int, "a positive integer"),
    "rms_norm_eps": (_positive_number, "a positive number"),
    "rope_theta": (_positive_number, "a positive number"),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "eagle_config": (lambda v: isinstance(v, dict), "an object"),
    AUX_IDS: (_layer_ids, "a list of non-negative integers"),
    "eagle_config.use_aux_hidden_state": (lambda v: isinstance(v, bool), "true or false"),
}
_MISSING = object()


def _get(head: dict, dotted: str) -> object:
    node: object = head
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def head_field_problems(head: dict, required: Iterable[str] = ()) -> list[str]:
    """Each required field that is missing, and each field present whose value is not of its kind."""
    problems = [f"no {name}" for name in required if _get(head, name) is _MISSING]
    for name, (accepts, kind) in KINDS.items():
        value = _get(head, name)
        if value is not _MISSING and not accepts(value):
            problems.append(f"{name} must be {kind}, not {value!r}"[:200])
    return problems


def check_head_fields(head: dict, path: Path, required: Iterable[str] = ()) -> None:
    """Refused naming `path` (the head's config.json) and every field that is missing or of the wrong kind."""
    problems = head_field_problems(head, required)
    if problems:
        raise Refused(f"EAGLE-3 head config {path}: {'; '.join(problems)}; fix the file (or train a head with "
                      "+option=D)")
