"""Kimi-K2.5's text-backbone shapes, read from its model conf (conf/model/kimi_k25_int4.yaml: `arch` and `moe`), the
one place they are written: box memory, the speedup model and the box benchmarks size from `KIMI`. Plain values
only (no resolvers), so a GPU host's bundle reads it too."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from experiments.config.paths import ROOT

KIMI_YAML = ROOT / "conf" / "model" / "kimi_k25_int4.yaml"


@dataclass(frozen=True)
class KimiShapes:
    hidden: int
    layers: int
    dense_layers: int
    heads: int
    kv_heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    intermediate: int
    moe_intermediate: int
    routed_experts: int
    shared_experts: int
    top_k: int
    vocab: int
    group_size: int


# KimiShapes field -> key of the yaml's `arch` (config.json text_config names); the experts come from `moe`
ARCH_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "dense_layers": "first_k_dense_replace",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "q_lora": "q_lora_rank",
             "kv_lora": "kv_lora_rank", "rope": "qk_rope_head_dim", "nope": "qk_nope_head_dim",
             "v_head": "v_head_dim", "intermediate": "intermediate_size", "moe_intermediate": "moe_intermediate_size",
             "shared_experts": "n_shared_experts", "vocab": "vocab_size", "group_size": "int4_group_size"}
MOE_KEYS = {"routed_experts": "num_experts", "top_k": "top_k"}


def kimi_shapes(path: Path = KIMI_YAML) -> KimiShapes:
    """The shapes in the model yaml at `path`."""
    conf = OmegaConf.load(path)
    return KimiShapes(**{f: int(conf.arch[k]) for f, k in ARCH_KEYS.items()},
                      **{f: int(conf.moe[k]) for f, k in MOE_KEYS.items()})


KIMI = kimi_shapes()
