"""Checks that refuse a run before anything is launched, each with a message that says what to do."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.config.errors import Refused  # noqa: F401  (re-exported for the callers)
from experiments.engines.config import available_on_site, engine_name, sglang_patches_for, site_args
from experiments.engines.knobs import refuse_unused_knobs
from sglang_patches import UnknownPatch, resolve


def check_option(cfg: DictConfig) -> None:
    if cfg.option is None:
        raise Refused("choose an experiment with +option=X, X one of baseline, A, B, C, D, E "
                      "(conf/option/)")
    opt = cfg.option
    if not OmegaConf.select(opt, "runner._target_"):
        raise Refused(f"option {opt.name} names no runner (option.runner._target_ in conf/option/{opt.name}.yaml)")
    site_engines = list(cfg.site.engines)
    if opt.engine and opt.engine not in site_engines:
        alt = opt.get("alternative")
        hint = f"; option {alt} runs the same drafter on {site_engines[0]}" if alt else ""
        if opt.get("offline"):
            hint += f"; on this site it runs offline: {opt.offline}"
        raise Refused(f"option {opt.name} ({opt.title}) needs {opt.engine}, which site "
                      f"{cfg.site.name} does not have (it has {site_engines}){hint}")
    if not available_on_site(cfg):
        raise Refused(f"engine {engine_name(cfg)} is not available on site {cfg.site.name} "
                      f"(it has {site_engines})")
    check_patches(cfg)
    refuse_unused_knobs(cfg)
    if cfg.spec.get("moe_expert_budget") is not None:
        check_moe_model(cfg)
    if cfg.spec.method == "eagle3" and not cfg.spec.draft_model:
        raise Refused(f"option {opt.name} needs an EAGLE-3 head for model {cfg.model.name}, and none is "
                      f"configured (model.drafters.eagle3 is empty): train one with +option=D "
                      f"or set spec.draft_model=/path/to/head")


def check_patches(cfg: DictConfig) -> None:
    """Patches exist and reach SGLang through the launcher; a budget is a positive integer (B >= the model's
    routed experts = unbudgeted); expert telemetry runs without CUDA graphs (graph replays run no Python)."""
    patches = sglang_patches_for(cfg)
    try:
        resolve(patches)
    except UnknownPatch as exc:
        raise Refused(str(exc)) from None
    if patches and cfg.engine.module != "sglang_patches.launch":
        raise Refused(f"patches {patches} need engine.module=sglang_patches.launch (it is {cfg.engine.module})")
    budget = str(cfg.spec.get("moe_expert_budget"))
    if "moe_budget" in patches and not (budget.isdigit() and int(budget) >= 1):
        raise Refused(f"spec.moe_expert_budget must be a positive integer, got {budget!r}")
    args = [*site_args(cfg), *cfg.engine.extra_args]
    if "expert_telemetry" in patches and "--disable-cuda-graph" not in args:
        raise Refused("spec.moe_telemetry=true counts experts in Python, which CUDA-graph replays skip: add "
                      "'engine.extra_args=[--disable-cuda-graph]' (the baseline then runs without graphs too)")


def check_moe_model(cfg: DictConfig) -> None:
    """An expert budget needs routed experts: a model whose config.json is here and has none is refused by name
    (a model not on this machine, e.g. the box's Kimi-K2.5 from here, is checked where it is served)."""
    from sglang_patches import PatchRefused
    from sglang_patches.moe_budget import refuse_unless_moe

    config = Path(str(cfg.model.path)) / "config.json"
    if config.exists():
        try:
            refuse_unless_moe(json.loads(config.read_text()))
        except PatchRefused as exc:
            raise Refused(f"option {cfg.option.name} needs a MoE model; model {cfg.model.name}: {exc} "
                          f"(the small MoE: model=tiny_moe_dsv3)") from None


def check_assets(cfg: DictConfig) -> None:
    model = Path(str(cfg.model.path))
    if not (model / "config.json").exists():
        how = ("run `bin/setup` (python -m experiments.hosts.setup_embedded) once" if cfg.model.embedded
               else f"set model.path (or its environment variable) to the folder of {cfg.model.hf_id}")
        raise Refused(f"model {cfg.model.name}: no Hugging Face folder at {model}; {how}")
    if cfg.spec.method == "eagle3":
        head = Path(str(cfg.spec.draft_model))
        if not (head / "config.json").exists():
            raise Refused(f"EAGLE-3 head not found at {head}: train one with +option=D "
                          f"(it is saved there) or set spec.draft_model=/path/to/head")
        check_head_fits(head, model)
    python = Path(str(cfg.engine.python))
    if python.is_absolute() and not python.exists():
        raise Refused(f"engine {engine_name(cfg)}: interpreter {python} does not exist; "
                      + ("run `bin/setup` once" if cfg.model.embedded else "set engine.python"))


def check_head_fits(head: Path, model: Path) -> None:
    """An EAGLE-3 head must match its target: hidden size, vocabulary, aux layers inside its depth."""
    h = json.loads((head / "config.json").read_text())
    t = json.loads((model / "config.json").read_text())
    t = t.get("text_config", t)
    problems = []
    if h.get("target_hidden_size", h.get("hidden_size")) != t["hidden_size"]:
        problems.append(f"hidden size {h.get('target_hidden_size', h.get('hidden_size'))} vs the target's "
                        f"{t['hidden_size']}")
    if h.get("vocab_size") != t["vocab_size"]:
        problems.append(f"vocabulary {h.get('vocab_size')} vs the target's {t['vocab_size']}")
    ids = (h.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    beyond = [i for i in ids if not 0 <= int(i) < t["num_hidden_layers"]]
    if beyond:
        problems.append(f"aux layer ids {beyond} beyond the target's {t['num_hidden_layers']} layers")
    if problems:
        raise Refused(f"EAGLE-3 head {head} does not fit target {model}: " + "; ".join(problems))
