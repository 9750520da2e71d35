"""Kimi-K2.5's shapes have one source, conf/model/kimi_k25_int4.yaml (`arch`, `moe`): the loader reads what Hydra
composes, and the miniature's hf_config (conf/model/kimi_k25_mini.yaml, each value cited there) differs from them
only in its number of layers."""
from __future__ import annotations

from conftest import compose_cfg
from omegaconf import OmegaConf

from experiments.config.kimi import ARCH_KEYS, KIMI, MOE_KEYS
from experiments.config.paths import ROOT

# KimiShapes field -> the miniature's hf_config key, where the two names differ from the yaml's `arch` / `moe`
MINI_KEYS = {**ARCH_KEYS, "routed_experts": "n_routed_experts", "top_k": "num_experts_per_tok"}


def test_the_loader_reads_what_hydra_composes() -> None:
    model = compose_cfg("model=kimi_k25_int4").model
    assert {f: getattr(KIMI, f) for f in ARCH_KEYS} == {f: model.arch[k] for f, k in ARCH_KEYS.items()}
    assert {f: getattr(KIMI, f) for f in MOE_KEYS} == {f: model.moe[k] for f, k in MOE_KEYS.items()}
    assert (KIMI.hidden, KIMI.layers, KIMI.routed_experts, KIMI.top_k, KIMI.vocab) == (7168, 61, 384, 8, 163840)


def test_kimi_shapes_match_the_miniatures_cited_config() -> None:
    hf = OmegaConf.load(ROOT / "conf/model/kimi_k25_mini.yaml").hf_config
    same = {f: k for f, k in MINI_KEYS.items() if f not in ("layers", "group_size")}
    assert {f: getattr(KIMI, f) for f in same} == {f: hf[k] for f, k in same.items()}
    assert KIMI.group_size == hf.quantization_config.config_groups.group_0.weights.group_size
