"""Option D on the box: SpecForge (sgl-project/SpecForge, `specforge train -c recipe.yaml`) instead of the
embedded CPU trainer. Here we compose its offline EAGLE-3 recipe and draft config for the site's target,
check the recipe with SpecForge's own schema, and log the plan as a `D-plan` MLflow run; training runs on
the box, where the target fits (all eight GPUs hold Kimi-K2.5, so features are captured first, offline).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from experiments.config.overlays import with_option
from experiments.config.paths import cache_dir
from experiments.engines.config import engine_tags
from experiments.harness.launch import build_launch_spec
from experiments.harness.measure import console
from experiments.harness.preflight import Refused
from experiments.tracking.runs import open_run
from experiments.tracking.store import flatten

SPECFORGE_TARGET = cache_dir() / "specforge-pkg"   # `pip install --no-deps --target` by bin/setup


def draft_config(cfg: DictConfig) -> dict:
    """The EAGLE-3 head SpecForge trains and SGLang/vLLM serve (LlamaForCausalLMEagle3, one decoder layer),
    sized from the target: its config.json when the folder is here, the model conf's `arch` otherwise.
    Aux layers low/middle/high as SpecForge's DeepSeek-V3 draft config picks them for 61 layers."""
    arch = OmegaConf.to_container(cfg.model.arch, resolve=True)
    target_json = Path(str(cfg.model.path)) / "config.json"
    if target_json.exists():
        t = json.loads(target_json.read_text())
        arch.update({k: v for k, v in t.get("text_config", t).items() if k in arch})
    n, sf = arch["num_hidden_layers"], cfg.train.specforge
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4], "use_aux_hidden_state": True},
        "hidden_size": arch["hidden_size"], "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": sf.draft_num_kv_heads, "intermediate_size": sf.draft_intermediate_size,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "initializer_range": 0.02,
        "max_position_embeddings": int(cfg.model.max_model_len), "tie_word_embeddings": False,
        "vocab_size": arch["vocab_size"], "draft_vocab_size": sf.draft_vocab_size,
        "bos_token_id": arch["bos_token_id"], "eos_token_id": arch["eos_token_id"], "pad_token_id": 0,
        "torch_dtype": "bfloat16", "use_cache": True,
    }


def recipe(cfg: DictConfig, work: Path) -> dict:
    """SpecForge's run config (specforge/config/schema.py): offline features, colocated trainer, MLflow."""
    sf = cfg.train.specforge
    return {
        "model": {"target_model_path": str(cfg.model.path), "draft_model_config": str(work / "draft_config.json"),
                  "trust_remote_code": bool(cfg.model.trust_remote_code),
                  "vocab_mapping_path": str(work / "hidden_states" / "vocab_mapping" / "vocab_mapping.pt"),
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(work / "hidden_states"), "max_length": int(sf.max_length),
                 "chat_template": str(cfg.model.chat_template), "cache_dir": str(work / "cache")},
        "training": {"strategy": "eagle3", "num_epochs": int(sf.num_epochs), "batch_size": int(sf.batch_size),
                     "learning_rate": float(sf.learning_rate), "ttt_length": int(sf.ttt_length),
                     "seed": int(cfg.train.seed), "save_interval": int(sf.save_interval), "tp_size": 1},
        "tracking": {"report_to": str(sf.report_to), "mlflow_tracking_uri": str(cfg.tracking.uri),
                     "mlflow_experiment_name": str(cfg.tracking.experiment),
                     "mlflow_run_name": f"D-specforge-{cfg.model.name}"},
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": int(sf.nproc_per_node)}},
        "run_id": f"{cfg.model.name}-eagle3", "output_dir": str(work / "output"),
    }


def commands(cfg: DictConfig, work: Path) -> list[str]:
    """The box-side pipeline: regenerate answers with the target (served with this site's SGLang flags),
    capture its hidden states at the aux layers, train, export for SGLang, evaluate as option B."""
    sf, q = cfg.train.specforge, shlex.quote
    serve = build_launch_spec(with_option(cfg, "baseline"))
    server = " ".join(q(a) for a in [*serve.argv[:-4], "--host", "127.0.0.1", "--port", "30000"])
    env = " ".join(f"{k}={q(v)}" for k, v in serve.env.items())
    scripts = f"{q(str(sf.repo))}/scripts"
    data, regen = work / "data" / f"{sf.dataset}_train.jsonl", work / "data" / "regenerated.jsonl"
    head = work / "head"
    return [
        f"python {scripts}/prepare_data.py --dataset {sf.dataset} --output-path {q(str(work / 'data'))} "
        f"--sample-size {sf.num_samples}",
        f"{env} {server} &  # the target, this site's flags; wait for /health",
        f"python {scripts}/regenerate_train_data.py --model {q(str(cfg.model.path))} --server-address 127.0.0.1:30000 "
        f"--input-file-path {q(str(data))} --output-file-path {q(str(regen))} --max-tokens {sf.max_length} "
        f"--temperature 0 --concurrency {sf.regen_concurrency}",
        "kill %1  # stop the target before the capture loads it again",
        f"torchrun --nproc_per_node {sf.nproc_per_node} {scripts}/prepare_hidden_states.py "
        f"--target-model-path {q(str(cfg.model.path))} --trust-remote-code "
        f"--draft-model-config {q(str(work / 'draft_config.json'))} --data-path {q(str(regen))} "
        f"--output-path {q(str(work / 'hidden_states'))} --chat-template {cfg.model.chat_template} "
        f"--max-length {sf.max_length} --tp-size {sf.nproc_per_node} --batch-size {sf.capture_batch_size} "
        f"--sglang-attention-backend triton --sglang-mem-fraction-static {sf.capture_mem_fraction}",
        f"specforge train -c {q(str(work / 'recipe.yaml'))} --plan",
        f"specforge train -c {q(str(work / 'recipe.yaml'))}",
        f"specforge export --to sglang --checkpoint {q(str(work / 'output' / f'{cfg.model.name}-eagle3-latest'))} "
        f"--draft-config {q(str(work / 'draft_config.json'))} --output-dir {q(str(head))}",
        f"python -m experiments.run +option=B spec.draft_model={q(str(head))}",
    ]


def validate_recipe(path: Path) -> tuple[bool, str]:
    """SpecForge's own schema (pydantic, imports nothing heavy) in a child with its --target dir on the path."""
    if not (SPECFORGE_TARGET / "specforge" / "config" / "schema.py").exists():
        return False, f"SpecForge is not installed at {SPECFORGE_TARGET} (bin/setup installs it)"
    code = ("import sys; from specforge.config import load_config; c = load_config(sys.argv[1]); "
            "print(c.mode, c.deployment.mode, c.tracking.report_to)")
    env = {**os.environ, "PYTHONPATH": str(SPECFORGE_TARGET)}
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                          timeout=120)
    tail = (proc.stdout if proc.returncode == 0 else proc.stderr).strip().splitlines()
    return proc.returncode == 0, "\n".join(tail[-12:])


def plan(cfg: DictConfig) -> dict:
    """A `D-plan` run: recipe, draft config and commands written to the work folder (where the commands
    read them) and logged as artifacts, after SpecForge's own schema accepted the recipe."""
    work = Path(str(cfg.train.specforge.work_dir))
    work.mkdir(parents=True, exist_ok=True)
    steps = commands(cfg, work)
    files = {"draft_config.json": json.dumps(draft_config(cfg), indent=2) + "\n",
             "recipe.yaml": yaml.safe_dump(recipe(cfg, work), sort_keys=False),
             "commands.sh": f"#!/usr/bin/env bash\n# Option D for {cfg.model.name} on site {cfg.site.name}: "
                            f"run on the box from the workspace root.\nset -euo pipefail\n" + "\n".join(steps) + "\n"}
    for name, text in files.items():
        (work / name).write_text(text)
    ok, verdict = validate_recipe(work / "recipe.yaml")
    if not ok:
        raise Refused(f"SpecForge's config schema refused the composed recipe {work / 'recipe.yaml'}:\n{verdict}")
    tags = engine_tags(cfg, "specforge") | {"specws.specforge_check": verdict}
    params = {k: v for k, v in flatten(cfg).items() if k.startswith(("train.", "model.", "site.name", "option."))}
    with open_run(cfg, "plan", "D-plan", tags, params) as run:
        for name in files:
            run.client.log_artifact(run.id, str(work / name), "specforge")
    run_id = run.id
    console.print(f"MLflow run [bold]D-plan[/] ({run_id}): SpecForge's schema accepted the recipe ({verdict}).\n"
                  f"Training runs on the box: bash {work / 'commands.sh'}, i.e.\n  " + "\n  ".join(steps))
    return {"run_id": run_id, "specforge_check": verdict, "commands": steps, "work_dir": str(work)}
