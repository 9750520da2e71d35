"""Engine adapters: the only place where SGLang and vLLM differ (flags, requests, metrics)."""
from __future__ import annotations

from experiments.engines.base import EngineAdapter, RequestAcceptance
from experiments.engines.limits import limits_mismatch

__all__ = ["EngineAdapter", "RequestAcceptance", "adapter_for", "limits_mismatch"]


def adapter_for(name: str) -> EngineAdapter:
    from experiments.engines.sglang_engine import SGLangAdapter
    from experiments.engines.vllm_engine import VLLMAdapter

    adapters = {"vllm": VLLMAdapter, "sglang": SGLangAdapter}
    if name not in adapters:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(adapters)}")
    return adapters[name]()
