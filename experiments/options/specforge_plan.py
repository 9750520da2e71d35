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
from experiments.config.views import views_of
from experiments.engines.config import engine_tags
from experiments.harness.launch import build_launch_spec
from experiments.harness.measure import console
from experiments.harness.preflight import Refused
from experiments.options.specforge_forms import (
    chat_templates,
    check_commands,
    dir_reader,
    load_sheet,
    program_flags,
)
from experiments.tracking.runs import open_run
from experiments.tracking.store import flatten

SPECFORGE_TARGET = cache_dir() / "specforge-pkg"   # `pip install --no-deps --target` by bin/setup
# SpecForge trains no MLA EAGLE-3 draft; SGLang 0.5.23 would serve one (docs/reference/specforge.md)
DRAFT = "LlamaForCausalLMEagle3 (one Llama decoder layer, GQA)"


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
                  "embedding_key": str(sf.embedding_key), "lm_head_key": str(sf.lm_head_key),
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


def _pin(cfg: DictConfig, label: str) -> str:
    """Check the SpecForge clone out at the commit whose flags the fact sheet recorded for this form."""
    repo, commit = shlex.quote(str(cfg.train.specforge.repo)), load_sheet(label)["commit"]
    return f"git -C {repo} checkout --detach {commit}  # {label} in specforge_flags.json"


def _data_and_answers(cfg: DictConfig, work: Path) -> list[str]:
    """ShareGPT (a seeded sample) and the team's own traffic (ShareGPT-format JSON/JSONL, when the file is
    there), merged, then answered again by the target served with this site's flags."""
    sf, q = cfg.train.specforge, shlex.quote
    serve = build_launch_spec(views_of(with_option(cfg, "baseline")))
    server = " ".join(q(a) for a in [*serve.argv[:-4], "--host", "127.0.0.1", "--port", "30000"])
    env = " ".join(f"{k}={q(v)}" for k, v in serve.env.items())
    scripts, data, traffic = f"{q(str(sf.repo))}/scripts", work / "data", q(str(sf.traffic_path))
    return [
        f"python {scripts}/prepare_data.py --dataset {sf.dataset} --output-path {q(str(data / 'sharegpt'))} "
        f"--sample-size {sf.num_samples}",
        f"if [ -s {traffic} ]; then python {scripts}/prepare_data.py --dataset sharegpt --data-path {traffic} "
        f"--output-path {q(str(data / 'traffic'))}; fi",
        f"cat {q(str(data))}/*/sharegpt_train.jsonl > {q(str(data / 'train.jsonl'))}",
        f"{env} {server} &  # the target, this site's flags; wait for /health",
        f"python {scripts}/regenerate_train_data.py --model {q(str(cfg.model.path))} --server-address 127.0.0.1:30000 "
        f"--input-file-path {q(str(data / 'train.jsonl'))} --output-file-path {q(str(data / 'regenerated.jsonl'))} "
        f"--max-tokens {sf.max_length} --temperature 0 --concurrency {sf.regen_concurrency}",
        "kill %1  # stop the target before the capture loads it again",
    ]


def _capture(cfg: DictConfig, work: Path, layer_flags: str) -> str:
    sf, q = cfg.train.specforge, shlex.quote
    return (f"torchrun --nproc_per_node {sf.nproc_per_node} {q(str(sf.repo))}/scripts/prepare_hidden_states.py "
            f"--target-model-path {q(str(cfg.model.path))} {layer_flags} "
            f"--data-path {q(str(work / 'data' / 'regenerated.jsonl'))} --output-path {q(str(work / 'hidden_states'))} "
            f"--chat-template {cfg.model.chat_template} --max-length {sf.max_length} --tp-size {sf.nproc_per_node} "
            f"--batch-size {sf.capture_batch_size} --sglang-attention-backend triton "
            f"--sglang-mem-fraction-static {sf.capture_mem_fraction}")


def commands(cfg: DictConfig, work: Path) -> list[str]:
    """The current form (SpecForge HEAD and the PyPI wheel): regenerate, capture the aux-layer features,
    `specforge train -c recipe.yaml`, export for SGLang, evaluate as option B."""
    q, draft, head = shlex.quote, work / "draft_config.json", work / "head"
    return [
        _pin(cfg, "head"), *_data_and_answers(cfg, work),
        _capture(cfg, work, f"--trust-remote-code --draft-model-config {q(str(draft))}"),
        f"specforge train -c {q(str(work / 'recipe.yaml'))} --plan",
        f"specforge train -c {q(str(work / 'recipe.yaml'))}",
        f"specforge export --to sglang --checkpoint {q(str(work / 'output' / f'{cfg.model.name}-eagle3-latest'))} "
        f"--draft-config {q(str(draft))} --output-dir {q(str(head))}",
        f"python -m experiments.run +option=B spec.draft_model={q(str(head))}",
    ]


def scripts_commands(cfg: DictConfig, work: Path) -> list[str]:
    """The scripts form (SpecForge before `specforge train`): the same data and capture, then
    `torchrun scripts/train_eagle3.py`, whose epoch_*_step_* folders SGLang loads as they are."""
    sf, q = cfg.train.specforge, shlex.quote
    out, draft, aux = work / "output-scripts", work / "draft_config.json", draft_config(cfg)["eagle_config"]
    layers = ",".join(str(i) for i in aux["eagle_aux_hidden_state_layer_ids"])
    train = (f"torchrun --standalone --nproc_per_node {sf.nproc_per_node} {q(str(sf.repo))}/scripts/train_eagle3.py "
             f"--target-model-path {q(str(cfg.model.path))} --draft-model-config {q(str(draft))} "
             f"--embedding-key {sf.embedding_key} --lm-head-key {sf.lm_head_key} "
             f"--train-data-path {q(str(work / 'data' / 'regenerated.jsonl'))} "
             f"--train-hidden-states-path {q(str(work / 'hidden_states'))} --output-dir {q(str(out))} "
             f"--cache-dir {q(str(work / 'cache'))} --chat-template {cfg.model.chat_template} "
             f"--max-length {sf.max_length} --num-epochs {sf.num_epochs} --batch-size {sf.batch_size} "
             f"--learning-rate {sf.learning_rate} --ttt-length {sf.ttt_length} --save-interval {sf.save_interval} "
             f"--seed {cfg.train.seed} --report-to {sf.report_to} --mlflow-tracking-uri {q(str(cfg.tracking.uri))} "
             f"--mlflow-experiment-name {q(str(cfg.tracking.experiment))} "
             f"--mlflow-run-name D-specforge-scripts-{cfg.model.name}")
    return [
        _pin(cfg, "last-scripts"), *_data_and_answers(cfg, work),
        _capture(cfg, work, f"--enable-aux-hidden-states --aux-hidden-states-layers {layers}"), train,
        f"CKPT=$(ls -d {q(str(out))}/epoch_*_step_* | sort -V | tail -1)",
        'python -m experiments.run +option=B spec.draft_model="$CKPT"',
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


def check_current(steps: list[str]) -> list[str]:
    """The current form's flags: `specforge` subcommands against the installed wheel's cli.py (read live),
    the helper scripts against HEAD's (fact sheet), chat templates against the wheel's registry."""
    head = load_sheet("head")
    wheel = dir_reader(SPECFORGE_TARGET)
    programs = {**head["programs"], "specforge/cli.py": program_flags(wheel, "specforge/cli.py")}
    return check_commands(steps, programs, chat_templates(wheel))


def check_scripts(steps: list[str], label: str = "last-scripts") -> list[str]:
    """The scripts form against one revision of the fact sheet (its scripts' flags and chat templates)."""
    rev = load_sheet(label)
    return check_commands(steps, rev["programs"], rev["chat_templates"])


def draft_params(head: dict) -> int:
    """Trainable parameters of the one-layer Llama EAGLE-3 head (the target's embedding stays frozen): fc over
    the aux layers, attention over [embedding, hidden] (2 x hidden in), the MLP, the draft-vocabulary head."""
    h, inter = head["hidden_size"], head["intermediate_size"]
    n_aux = len(head["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    hd = h // head["num_attention_heads"]
    q, kv = head["num_attention_heads"] * hd, head["num_key_value_heads"] * hd
    return n_aux * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * inter + h * head["draft_vocab_size"]


def hours_estimate(cfg: DictConfig) -> dict:
    """Hours on the box from stated inputs (an estimate: nothing here was measured on the box)."""
    sf, e, head = cfg.train.specforge, cfg.train.specforge.estimate, draft_config(cfg)
    samples = int(sf.num_samples) + int(e.traffic_samples)
    tokens = samples * min(int(e.prompt_tokens) + int(e.answer_tokens), int(sf.max_length))
    bytes_per_token = (len(head["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) + 1) * head["hidden_size"] * 2
    flops_per_token = 6 * draft_params(head) * int(sf.ttt_length) + 2 * head["hidden_size"] * head["vocab_size"]
    disk = float(e.disk_gb_s) * 1e9
    per_token_train = max(flops_per_token / (int(sf.nproc_per_node) * float(e.train_tflops_per_gpu) * 1e12),
                          bytes_per_token / disk)
    hours = {"target_loads": 2 * float(e.target_load_minutes) / 60,
             "regenerate": samples * int(e.answer_tokens) / float(e.regen_tok_s) / 3600,
             "capture": tokens * max(1 / float(e.capture_tok_s), bytes_per_token / disk) / 3600,
             "train": int(sf.num_epochs) * tokens * per_token_train / 3600}
    return {"kind": "estimate from assumed inputs, not a measurement",
            "formula": {"regenerate": "samples x answer_tokens / regen_tok_s",
                        "capture": "tokens x max(1 / capture_tok_s, bytes_per_token / disk)",
                        "train": "epochs x tokens x max(flops_per_token / (gpus x train_tflops_per_gpu), "
                                 "bytes_per_token / disk)",
                        "flops_per_token": "6 x draft_params x ttt_length + 2 x hidden x vocab (target logits)",
                        "target_loads": "2 x target_load_minutes (served for answers, loaded again to capture)"},
            "inputs": {**OmegaConf.to_container(e, resolve=True), "samples": samples, "tokens": tokens,
                       "bytes_per_token": bytes_per_token, "draft_params": draft_params(head),
                       "flops_per_token": flops_per_token, "epochs": int(sf.num_epochs),
                       "gpus": int(sf.nproc_per_node)},
            "hours": {k: round(v, 2) for k, v in hours.items()} | {"total": round(sum(hours.values()), 1)},
            "disk_tb": round(tokens * bytes_per_token / 1e12, 2)}


def _forms(cfg: DictConfig, work: Path) -> dict[str, dict]:
    """Both forms' files, each checked against its own release; a form its own check refuses stops the plan."""
    current, scripts = commands(cfg, work), scripts_commands(cfg, work)
    ok, verdict = validate_recipe(work / "recipe.yaml")
    if not ok:
        raise Refused(f"SpecForge's config schema refused the composed recipe {work / 'recipe.yaml'}:\n{verdict}")
    problems = {"current": check_current(current), "v0.2.0-scripts": check_scripts(scripts)}
    if any(problems.values()):
        raise Refused("SpecForge's command lines use flags their release does not know:\n" +
                      "\n".join(f"{k}: {p}" for k, ps in problems.items() for p in ps))
    sheet = {k: load_sheet(k) for k in ("head", "last-scripts", "v0.2.0")}
    release = check_scripts(scripts, "v0.2.0")
    return {
        "current": {"steps": current, "check": f"schema of the installed specforge {_wheel_version()} ({verdict}); "
                    f"flags: its specforge/cli.py, scripts at {sheet['head']['commit'][:10]}: ok"},
        "v0.2.0-scripts": {"steps": scripts, "check": (
            f"flags: scripts at {sheet['last-scripts']['commit'][:10]} (last with train_eagle3.py, version.txt "
            f"{sheet['last-scripts']['version_txt']}): ok; at the v0.2.0 release {sheet['v0.2.0']['commit'][:10]}: "
            + ("; ".join(release) or "ok"))},
        "verdict": verdict,
    }


def _wheel_version() -> str:
    meta = next(SPECFORGE_TARGET.glob("specforge-*.dist-info"), None)
    return meta.name.removeprefix("specforge-").removesuffix(".dist-info") if meta else "?"


def _script(cfg: DictConfig, steps: list[str], form: str) -> str:
    return (f"#!/usr/bin/env bash\n# Option D for {cfg.model.name} on site {cfg.site.name}, SpecForge {form}: "
            f"run on the box from the workspace root.\nset -euo pipefail\n" + "\n".join(steps) + "\n")


def plan(cfg: DictConfig) -> dict:
    """A `D-plan` run: both forms' commands, the recipe and draft config written to the work folder (where the
    commands read them), each form checked against its own release, the hours estimate; all logged."""
    work = Path(str(cfg.train.specforge.work_dir))
    work.mkdir(parents=True, exist_ok=True)
    estimate = hours_estimate(cfg)
    (work / "draft_config.json").write_text(json.dumps(draft_config(cfg), indent=2) + "\n")
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe(cfg, work), sort_keys=False))
    forms = _forms(cfg, work)
    files = {"current": {"draft_config.json": None, "recipe.yaml": None,
                         "commands.sh": _script(cfg, forms["current"]["steps"], "current (specforge train)")},
             "v0.2.0-scripts": {"draft_config.json": None, "commands-scripts.sh": _script(
                 cfg, forms["v0.2.0-scripts"]["steps"], "scripts (torchrun scripts/train_eagle3.py)")}}
    for form in files.values():
        for name, text in form.items():
            if text is not None:
                (work / name).write_text(text)
    (work / "estimate.json").write_text(json.dumps(estimate, indent=2) + "\n")
    run_view = views_of(cfg)
    tags = engine_tags(run_view, "specforge") | {
        "specws.specforge_check": forms["verdict"], "specws.specforge.draft": DRAFT,
        "specws.specforge.hours_estimate": str(estimate["hours"]["total"])}
    tags |= {f"specws.specforge.{k}.check": forms[k]["check"] for k in files}
    params = {k: v for k, v in flatten(cfg).items() if k.startswith(("train.", "model.", "site.name", "option."))}
    with open_run(run_view, "plan", "D-plan", tags, params) as run:
        for form, names in files.items():
            for name in names:
                run.client.log_artifact(run.id, str(work / name), f"specforge/{form}")
        run.client.log_artifact(run.id, str(work / "estimate.json"), "specforge")
    console.print(f"MLflow run [bold]D-plan[/] ({run.id}): {forms['current']['check']}\n"
                  f"scripts form: {forms['v0.2.0-scripts']['check']}\n"
                  f"Hours on the box ({estimate['kind']}): {estimate['hours']}, {estimate['disk_tb']} TB of features.\n"
                  f"Training runs on the box: bash {work / 'commands.sh'} (or {work / 'commands-scripts.sh'})")
    return {"run_id": run.id, "specforge_check": forms["verdict"], "commands": forms["current"]["steps"],
            "scripts_commands": forms["v0.2.0-scripts"]["steps"], "estimate": estimate, "work_dir": str(work)}
