"""The small MoE target in Kimi-K2.5's architecture (DeepSeek-V3): its config, loading, and routing traces.

Kimi-K2.5 is a DeepseekV3ForCausalLM: MLA attention (q/kv low-rank projections, decoupled RoPE), a first dense
layer, then MoE layers with routed + shared experts, sigmoid scores plus an `e_score_correction_bias` for
choosing (`topk_method: noaux_tc`), grouped top-k (`n_group`/`topk_group`), renormalised top-k weights times
`routed_scaling_factor`. This module builds the same thing at toy size over SmolLM2's 49152-token vocabulary.

Routing traces come from forward hooks on the HF router modules (`DeepseekV3TopkRouter`), which return
(router_logits, topk_weights, topk_indices) for every token of a forward.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from experiments.config.paths import cache_dir

MODEL_DIR_NAME = "tiny-moe-dsv3"
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class TinyMoeShape:
    """The architecture knobs (everything else follows DeepSeek-V3's defaults)."""
    hidden_size: int = 192
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 512          # the dense layer's MLP
    n_routed_experts: int = 32
    moe_intermediate_size: int = 64
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 4
    q_lora_rank: int = 96
    # vLLM's CPU MLA kernels (cpu_mla, amx_mla) only take the DeepSeek/Kimi latent size 512 + 64 = 576.
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    vocab_size: int = 49152


def model_dir() -> Path:
    return cache_dir() / "models" / MODEL_DIR_NAME


def smollm2_dir() -> Path:
    return cache_dir() / "models" / SMOLLM2_DIR_NAME


def make_config(shape: TinyMoeShape, bos_token_id: int, eos_token_id: int, pad_token_id: int):
    from transformers import DeepseekV3Config

    s = shape
    return DeepseekV3Config(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        moe_intermediate_size=s.moe_intermediate_size, num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_attention_heads,
        n_shared_experts=s.n_shared_experts, n_routed_experts=s.n_routed_experts,
        routed_scaling_factor=s.routed_scaling_factor, kv_lora_rank=s.kv_lora_rank, q_lora_rank=s.q_lora_rank,
        qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim, qk_nope_head_dim=s.qk_nope_head_dim,
        n_group=s.n_group, topk_group=s.topk_group, num_experts_per_tok=s.num_experts_per_tok,
        first_k_dense_replace=s.first_k_dense_replace, norm_topk_prob=True,
        max_position_embeddings=s.max_position_embeddings, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": s.rope_theta},
        tie_word_embeddings=False, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        num_nextn_predict_layers=0,
    )


# Fields the serving engines read from config.json that transformers' DeepseekV3Config does not write:
# vLLM and SGLang create `e_score_correction_bias` only for topk_method "noaux_tc" and default scoring_func
# to "softmax" — without these the served model would route differently from the trained one; SGLang 0.5.14
# failed on the H200 without moe_layer_freq ('DeepseekV3Config' object has no attribute 'moe_layer_freq').
ENGINE_CONFIG_FIELDS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
                        "moe_layer_freq": 1,
                        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                        "torch_dtype": "bfloat16"}


def load_model(path: Path | None = None, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path or model_dir(), dtype=dtype)
    return model.eval()


def moe_routers(model) -> list[torch.nn.Module]:
    """The router module of every MoE layer, in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


@dataclass
class RoutingTrace:
    """Per MoE layer, the routing of every forward since the trace started (tokens flattened batch-major)."""
    logits: list[list[torch.Tensor]] = field(default_factory=list)
    topk_ids: list[list[torch.Tensor]] = field(default_factory=list)
    topk_weights: list[list[torch.Tensor]] = field(default_factory=list)


# A routing transform takes (layer index, router_logits, topk_weights, topk_ids) and returns new
# (topk_weights, topk_ids): the hook through which the budget is applied to the HF forward.
RoutingTransform = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@contextmanager
def routing_hooks(model, transform: RoutingTransform | None = None,
                  keep_logits: bool = False) -> Iterator[RoutingTrace]:
    """Record (and optionally rewrite) the routing of every MoE layer while the context is open."""
    routers = moe_routers(model)
    trace = RoutingTrace([[] for _ in routers], [[] for _ in routers], [[] for _ in routers])
    handles = []

    def make_hook(i: int):
        def hook(_module, _inputs, output):
            logits, weights, ids = output
            if transform is not None:
                weights, ids = transform(i, logits, weights, ids)
            if keep_logits:
                trace.logits[i].append(logits.detach())
            trace.topk_ids[i].append(ids.detach())
            trace.topk_weights[i].append(weights.detach())
            return (logits, weights, ids) if transform is not None else None
        return hook

    for i, r in enumerate(routers):
        handles.append(r.register_forward_hook(make_hook(i)))
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()
