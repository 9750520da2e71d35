"""Run in SGLang 0.5.14's interpreter (PYTHONPATH=.cache/sglang-0.5.14): load a built miniature folder with SGLang's
own ModelConfig and quantization code on the CPU, print one JSON object of what SGLang made of it.

Usage: <python> sglang_kimi_check.py MODEL_DIR
"""
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "engines"))
from sglang_check import _declare_torchvision_ops_if_unloadable  # noqa: E402

# SGLang's own module names (models/deepseek_v2.py prefixes) of one dense and one MoE layer
LINEAR_LAYERS = {
    "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa": "ReplicatedLinear",
    "model.layers.0.self_attn.q_b_proj": "ColumnParallelLinear",
    "model.layers.0.self_attn.kv_b_proj": "ColumnParallelLinear",
    "model.layers.0.self_attn.o_proj": "RowParallelLinear",
    "model.layers.0.mlp.gate_up_proj": "MergedColumnParallelLinear",
    "model.layers.0.mlp.down_proj": "RowParallelLinear",
    "model.layers.1.self_attn.o_proj": "RowParallelLinear",
    "model.layers.1.mlp.shared_experts.gate_up_proj": "MergedColumnParallelLinear",
    "model.layers.1.mlp.shared_experts.down_proj": "RowParallelLinear",
}
MOE_LAYERS = ["model.layers.1.mlp.experts", "model.layers.3.mlp.experts"]


def _bare(cls):
    """An instance of SGLang's own layer class without running its constructor (which needs a process group):
    the quantization code only dispatches on the class and the name."""
    return object.__new__(cls)


def dummy_routing(text_config, tokens: int = 512, layers: int = 2) -> dict:
    """SGLang's own MoE gate and RMSNorm of `layers` MoE layers, filled by its dummy loader's
    initialize_dummy_weights, routing `tokens` random hidden states with its Kimi top-k (sigmoid + correction bias,
    one group): how many distinct experts the tokens reach, and whether that is just the bias's top-k."""
    import torch
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.moe.topk import kimi_k2_biased_topk_impl
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights
    from sglang.srt.models.deepseek_v2 import MoEGate

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    hidden = torch.randn(tokens, text_config.hidden_size, dtype=torch.bfloat16)
    out = {}
    gates = []
    for layer in range(1, layers + 1):
        block = torch.nn.Module()
        block.norm = RMSNorm(text_config.hidden_size, eps=text_config.rms_norm_eps)
        block.gate = MoEGate(text_config, quant_config=None, prefix=f"model.layers.{layer}.mlp.gate")
        block.to(torch.bfloat16)
        block.gate.e_score_correction_bias.data = block.gate.e_score_correction_bias.data.float()
        initialize_dummy_weights(block)
        logits = torch.nn.functional.linear(block.norm.forward_native(hidden), block.gate.weight).float()
        bias = block.gate.e_score_correction_bias
        _, ids = kimi_k2_biased_topk_impl(hidden, logits, bias, text_config.num_experts_per_tok, True,
                                          text_config.routed_scaling_factor)
        bias_top = set(torch.topk(bias, text_config.num_experts_per_tok).indices.tolist())
        out[f"layer_{layer}"] = {"distinct_experts": len(set(ids.flatten().tolist())),
                                 "all_tokens_pick_bias_topk": all(set(r) == bias_top for r in ids.tolist()),
                                 "max_abs_logit": float(logits.abs().max()),
                                 "max_abs_sigmoid_minus_half": float((logits.sigmoid() - 0.5).abs().max()),
                                 "max_abs_bias": float(bias.abs().max()), "bias_dtype": str(bias.dtype)}
        gates.append((block.gate.weight.clone(), bias.clone()))
    out["layers_identical"] = all(torch.equal(g[0], gates[0][0]) and torch.equal(g[1], gates[0][1]) for g in gates)
    return out


def check(model_dir: str) -> dict:
    _declare_torchvision_ops_if_unloadable()
    import sglang
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.layers import linear
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture

    mc = ModelConfig(model_dir, trust_remote_code=False, quantization="compressed-tensors", context_length=32768)
    text = mc.hf_text_config
    quant = _get_quantization_config(mc, LoadConfig(load_format="dummy"))
    linears = {name: type(quant.get_quant_method(_bare(getattr(linear, cls)), name)).__name__
               for name, cls in LINEAR_LAYERS.items()}
    # control: a routed expert's own projection is not ignored (its scheme dict is the INT4 one; picking its linear
    # method would check the GPU's compute capability, so only the dict is read on the CPU)
    control = quant.get_scheme_dict(_bare(linear.ColumnParallelLinear), "model.layers.1.mlp.experts.0.up_proj")
    moe = {}
    for name in MOE_LAYERS:
        layer = _bare(FusedMoE)
        method = quant.get_quant_method(layer, name)
        moe[name] = {"method": type(method).__name__, "scheme": type(layer.scheme).__name__}
    return {
        "version": sglang.__version__, "architectures": list(mc.hf_config.architectures),
        "mla": mc.attention_arch == AttentionArch.MLA, "kv_lora_rank": mc.kv_lora_rank,
        "qk_rope_head_dim": mc.qk_rope_head_dim, "qk_nope_head_dim": mc.qk_nope_head_dim,
        "v_head_dim": mc.v_head_dim, "scaling": mc.scaling, "context_len": mc.context_len,
        "vocab_size": mc.vocab_size, "dtype": str(mc.dtype), "quantization": mc.quantization,
        "text": {k: getattr(text, k) for k in (
            "hidden_size", "num_hidden_layers", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "moe_intermediate_size", "intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
            "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "q_lora_rank",
            "num_attention_heads", "num_key_value_heads", "bos_token_id", "eos_token_id")},
        "quant_config": type(quant).__name__, "ignore": list(quant.ignore),
        "linear_methods": linears, "moe": moe, "control_expert_weights": str((control or {}).get("weights")),
        "model_class": get_model_architecture(mc)[0].__name__,
        "dummy_routing": dummy_routing(text),
    }


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        out = check(sys.argv[1])
    print(json.dumps(out))
