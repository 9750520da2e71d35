"""Engine adapters: the only place where SGLang and vLLM differ (flags, requests, metrics)."""
from __future__ import annotations

from experiments.engines.base import EngineAdapter
from experiments.engines.limits import limits_mismatch

__all__ = ["ENGINE_NAMES", "adapter_for", "limits_mismatch"]

ENGINE_NAMES = ("sglang", "vllm")   # the registry's engines, one adapter each (adapter_for)


def adapter_for(name: str) -> EngineAdapter:
    from experiments.engines.sglang_engine import SGLangAdapter
    from experiments.engines.vllm_engine import VLLMAdapter

    adapters = dict(zip(ENGINE_NAMES, (SGLangAdapter, VLLMAdapter), strict=True))
    if name not in adapters:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(adapters)}")
    return adapters[name]()
