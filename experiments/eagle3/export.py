"""Export a trained head in the `LlamaForCausalLMEagle3` checkpoint layout (config.json + model.safetensors).

Tensors: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v take 2×hidden inputs), midlayer.mlp.{gate,up,down}_proj.weight,
norm.weight, lm_head.weight (draft vocab × hidden), d2t (int64, target id − draft id), t2d (bool over the target
vocab); no embed_tokens (both engines share the target's). vLLM renames midlayer → model.layers.0 and stacks
q/k/v and gate/up; SGLang renames midlayer → layers.0 and stacks the same way; both skip t2d.

Aux layer ids: vLLM uses `eagle_config.eagle_aux_hidden_state_layer_ids` as given (id k = input of layer k);
SGLang 0.5.23 adds 1 (`set_eagle3_layers_to_capture`: "for the ith layer, it takes the output of the (i-1)th
layer"). The same features therefore need ids − 1 for SGLang: `export_head` writes the vLLM folder and a
sibling `<name>-sglang` folder with the shifted ids and the same weights.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from experiments.eagle3.head import Eagle3Head, HeadConfig
from experiments.engines.head_layout import head_layout

EXPECTED_TENSORS = sorted(
    ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
    + [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    + [f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"]
    + [f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")])


def head_config_json(c: HeadConfig, engine: str = "vllm", dtype: str = "bfloat16") -> dict:
    layout = head_layout(engine)
    ids = layout.aux_layer_ids(c.aux_layer_ids)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "num_hidden_layers": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "target_hidden_size": c.hidden_size,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "specws_aux_layer_convention": layout.convention,
    }


def _write(dst: Path, config: dict, tensors: dict[str, torch.Tensor] | None, src: Path | None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    st = dst / "model.safetensors"
    if tensors is not None:
        tmp = dst / "model.safetensors.partial"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, st)
    elif src is not None and src.resolve() != st.resolve():
        st.unlink(missing_ok=True)
        try:
            os.link(src, st)
        except OSError:
            shutil.copyfile(src, st)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def export_head(head: Eagle3Head, out_dir: Path, *, sglang_dir: Path | None = None,
                dtype: str = "bfloat16") -> dict[str, Path]:
    """Write the vLLM folder `out_dir` and the SGLang folder (default `<out_dir>-sglang`). Float tensors are
    stored in `dtype`, d2t as int64, t2d as bool. Returns {"vllm": path, "sglang": path}."""
    out_dir = Path(out_dir)
    sglang_dir = Path(sglang_dir) if sglang_dir else out_dir.with_name(out_dir.name + "-sglang")
    want = getattr(torch, dtype)
    tensors = {k: (v.to(want) if v.is_floating_point() else v) for k, v in head.export_state_dict().items()}
    if sorted(tensors) != EXPECTED_TENSORS:
        raise RuntimeError(f"unexpected tensor names: {sorted(tensors)}")
    c = head.config
    _write(out_dir, head_config_json(c, "vllm", dtype), tensors, None)
    _write(sglang_dir, head_config_json(c, "sglang", dtype), None, out_dir / "model.safetensors")
    return {"vllm": out_dir, "sglang": sglang_dir}


def config_from_json(path: Path) -> HeadConfig:
    """The HeadConfig of an exported vLLM-layout folder."""
    cfg = json.loads(Path(path, "config.json").read_text())
    ids = tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return HeadConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                      num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                      head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
                      max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
                      draft_vocab_size=cfg["draft_vocab_size"], aux_layer_ids=ids)


def copy_head(src: Path, dst: Path) -> dict[str, Path]:
    """Install an exported vLLM-layout folder `src` as `dst` plus its SGLang sibling `<dst>-sglang` (the same
    safetensors bytes; config.json written for each engine)."""
    src, dst = Path(src), Path(dst)
    c = config_from_json(src)
    cfg = json.loads(Path(src, "config.json").read_text())
    dtype = cfg.get("torch_dtype", "bfloat16")
    dst.mkdir(parents=True, exist_ok=True)
    if src.resolve() != dst.resolve():
        tmp = dst / "model.safetensors.partial"
        shutil.copyfile(src / "model.safetensors", tmp)
        os.replace(tmp, dst / "model.safetensors")
        if (src / "specws_eagle3.json").exists():
            shutil.copyfile(src / "specws_eagle3.json", dst / "specws_eagle3.json")
    _write(dst, head_config_json(c, "vllm", dtype), None, None)
    sg = dst.with_name(dst.name + "-sglang")
    _write(sg, head_config_json(c, "sglang", dtype), None, dst / "model.safetensors")
    return {"vllm": dst, "sglang": sg}


def load_head(path: Path, embed_weight: torch.Tensor | None = None) -> Eagle3Head:
    """Rebuild a head from an exported vLLM-layout folder (embeddings: the target's, or zeros)."""
    c = config_from_json(path)
    if embed_weight is None:
        embed_weight = torch.zeros(c.vocab_size, c.hidden_size)
    head = Eagle3Head(c, embed_weight)
    state = load_file(str(Path(path, "model.safetensors")))
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return head
