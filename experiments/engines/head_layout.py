"""How each engine reads an EAGLE-3 head's aux layer ids, for the export that writes one folder per engine.

Kept free of third-party imports: the export runs on the H200 host and in vLLM's environment, which have neither
OmegaConf nor the adapters' dependencies. Each adapter names its layout (`EngineAdapter.head_layout`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadLayout:
    engine: str
    aux_id_offset: int    # subtracted from the workspace's ids (id k = input of target layer k)
    aux_id_meaning: str

    def aux_layer_ids(self, ids: tuple[int, ...] | list[int]) -> list[int]:
        if not ids:
            raise ValueError(f"no aux layer ids given for {self.engine}: an EAGLE-3 head needs at least one")
        shifted = [int(i) - self.aux_id_offset for i in ids]
        if min(shifted) < 0:
            raise ValueError(f"aux layer ids {list(ids)} cannot be expressed for {self.engine} ({self.aux_id_meaning})")
        return shifted

    @property
    def convention(self) -> str:
        return f"{self.engine}: {self.aux_id_meaning}"


# vLLM takes the ids as given; SGLang adds 1 (`set_eagle3_layers_to_capture`: "for the ith layer, it takes the
# output of the (i-1)th layer"), so the same features need ids - 1, and id 0 (the embeddings) has no SGLang id
HEAD_LAYOUTS = {
    "vllm": HeadLayout("vllm", 0, "id k = input of target layer k (hidden_states[k])"),
    "sglang": HeadLayout("sglang", 1, "id k = output of target layer k"),
}


def head_layout(engine: str) -> HeadLayout:
    if engine not in HEAD_LAYOUTS:
        raise ValueError(f"no EAGLE-3 head layout for engine {engine!r}; known: {sorted(HEAD_LAYOUTS)}")
    return HEAD_LAYOUTS[engine]
