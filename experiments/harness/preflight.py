"""Checks that refuse a run before anything is launched, each with a message that says what to do."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import httpx
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.config.errors import Refused  # noqa: F401  (re-exported for the callers)
from experiments.engines import adapter_for
from experiments.engines.config import available_on_site, engine_name, forced_patches, sglang_patches_for, site_args
from experiments.engines.knobs import refuse_unused_knobs
from experiments.tracking.offline_store import URI_PREFIX
from experiments.tracking.redact import redact_text
from experiments.tracking.store import sqlite_file
from sglang_patches import UnknownPatch, resolve

# Any one of these makes a Hugging Face folder's tokenizer loadable (fast, SentencePiece, BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "spiece.model")
ENGINE_PROBE_TIMEOUT_S = 30.0
# NVLink multicast off in every process of a multi-GPU site: on a shared host it can take the GPUs out of service.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TRACKING_TIMEOUT_S = 5.0


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
    check_multicast_off(cfg)
    check_patches(cfg)
    refuse_unused_knobs(cfg)
    if cfg.spec.get("moe_expert_budget") is not None:
        check_moe_model(cfg)
    if cfg.spec.method == "eagle3" and not cfg.spec.draft_model:
        raise Refused(f"option {opt.name} needs an EAGLE-3 head for model {cfg.model.name}, and none is "
                      f"configured (model.drafters.eagle3 is empty): train one with +option=D "
                      f"or set spec.draft_model=/path/to/head")


def check_multicast_off(cfg: DictConfig) -> None:
    """A site with more than one GPU must switch NVLink multicast off in NCCL, PyTorch and NVSHMEM, unless it
    says it has no NVLink (`site.nvlink: false`, the PCIe-only box)."""
    if int(cfg.site.get("gpus") or 1) <= 1 or cfg.site.get("nvlink") is False:
        return
    env = cfg.site.get("env") or {}
    wrong = {k: v for k, v in MULTICAST_OFF_ENV.items() if str(env.get(k)) != v}
    if wrong:
        raise Refused(f"site {cfg.site.name} has {cfg.site.gpus} GPUs but does not switch NVLink multicast off: "
                      "set " + ", ".join(f"site.env.{k}={v}" for k, v in wrong.items()))


def _flag_is(args: list[str], flag: str, value: str) -> bool:
    return any(a == flag and i + 1 < len(args) and args[i + 1] == value for i, a in enumerate(args)) or \
        f"{flag}={value}" in args


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
    args = [*site_args(cfg), *cfg.engine.extra_args]
    if "synthetic_router" in patches and not _flag_is(args, "--load-format", "dummy"):
        raise Refused("model.moe.router_skew replaces the router's logits (synthetic_router): only for a model "
                      "served with random weights (--load-format dummy); set model.moe.router_skew=null to serve "
                      "real weights")
    if unrequested := [n for n in forced_patches(cfg) if n not in patches]:
        raise Refused(f"site.patches_forced {unrequested} are not among the patches applied {patches}: "
                      "add them to site.patches")
    budget = str(cfg.spec.get("moe_expert_budget"))
    if "moe_budget" in patches and not (budget.isdigit() and int(budget) >= 1):
        raise Refused(f"spec.moe_expert_budget must be a positive integer, got {budget!r}")
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


def check_inputs(cfg: DictConfig) -> None:
    """What every runner reads, before the workload is read (dry runs included): a model folder that is here is
    complete, the tracking store answers."""
    model = Path(str(cfg.model.path))
    if model.exists():   # a model that is not here (the box's, checked from here) is checked where it is served
        check_model_folder(cfg)
    check_tracking(cfg)


def _model_fix(cfg: DictConfig) -> str:
    return ("run `bin/setup` (python -m experiments.hosts.setup_embedded) once" if cfg.model.embedded
            else f"set model.path (or its environment variable) to the folder of {cfg.model.hf_id}")


def check_model_folder(cfg: DictConfig) -> None:
    model = Path(str(cfg.model.path))
    if not (model / "config.json").is_file():
        raise Refused(f"model {cfg.model.name}: no Hugging Face folder at {model} (no config.json); {_model_fix(cfg)}")
    if not any((model / name).is_file() for name in TOKENIZER_FILES) and not any(model.glob("*.tiktoken")):
        raise Refused(f"model {cfg.model.name}: {model} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                      f"{_model_fix(cfg)}")


def check_engine_env(cfg: DictConfig) -> None:
    """The engine's interpreter exists and imports the engine (dry runs included: its parser checks the command
    line); a bare `python3` counts as set up when this interpreter imports the engine, as the engines then use it."""
    engine, python = engine_name(cfg), str(cfg.engine.python)
    fix = "run `bin/setup` once" if cfg.model.embedded else f"set engine.python to an interpreter with {engine}"
    bare = os.sep not in python
    if bare and importlib.util.find_spec(engine) is not None:
        return
    found = shutil.which(python) if bare else (python if Path(python).is_file() else None)
    if found is None:
        raise Refused(f"engine {engine}: interpreter {python} (engine.python) does not exist; {fix}")
    if not _imports(found, engine):
        raise Refused(f"engine {engine}: {python} (engine.python) cannot import {engine}; {fix}")


@cache
def _imports(python: str, package: str) -> bool:
    """`python` finds `package` (looked up, not imported: importing vLLM takes many seconds)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=ENGINE_PROBE_TIMEOUT_S).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_tracking(cfg: DictConfig) -> None:
    """The store of tracking.uri can be written (a local folder) or answers within seconds (a server)."""
    try:
        uri = str(cfg.tracking.uri)
    except OmegaConfBaseException as exc:
        raise Refused(f"tracking.uri cannot be resolved ({str(exc).splitlines()[0]}); set MLFLOW_TRACKING_URI "
                      "for tracking=server, or use tracking=local") from None
    shown = redact_text(uri)
    if uri.startswith(("http://", "https://")):
        _check_tracking_server(uri, shown)
        return
    if (db := sqlite_file(uri)) is not None:
        _check_folder(db.parent, shown)
    elif uri.startswith((URI_PREFIX, "file://")):
        _check_folder(Path(uri.split("://", 1)[1]), shown)
    elif "://" not in uri:   # a plain folder: MLflow's file store
        _check_folder(Path(uri), shown)


def _check_folder(folder: Path, shown: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Refused(f"tracking.uri={shown}: cannot create the folder {folder} ({exc.strerror or exc}); "
                      "point tracking.uri at a writable place") from None
    if not os.access(folder, os.W_OK):
        raise Refused(f"tracking.uri={shown}: the folder {folder} is not writable; point tracking.uri elsewhere")


def _check_tracking_server(uri: str, shown: str) -> None:
    try:
        reply = httpx.get(uri, timeout=TRACKING_TIMEOUT_S, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise Refused(f"tracking.uri={shown}: no answer within {TRACKING_TIMEOUT_S:.0f} s ({type(exc).__name__}: "
                      f"{redact_text(str(exc))}); start the tracking server or set tracking.uri") from None
    if reply.status_code in (401, 403):
        raise Refused(f"tracking.uri={shown}: the server refused access (HTTP {reply.status_code}); set "
                      "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN")


def check_assets(cfg: DictConfig) -> None:
    model = Path(str(cfg.model.path))
    check_model_folder(cfg)
    if cfg.spec.method == "eagle3":
        head = Path(str(cfg.spec.draft_model))
        if not (head / "config.json").exists():
            raise Refused(f"EAGLE-3 head not found at {head}: train one with +option=D "
                          f"(it is saved there) or set spec.draft_model=/path/to/head")
        check_head_fits(head, model)
        check_head_loads(cfg, head)
    check_engine_env(cfg)


def check_head_loads(cfg: DictConfig, head: Path) -> None:
    """Refused when the engine cannot load the head's config.json as it is (EngineAdapter.head_config_problems)."""
    problems = adapter_for(engine_name(cfg)).head_config_problems(json.loads((head / "config.json").read_text()))
    if problems:
        raise Refused(f"{engine_name(cfg)} cannot load EAGLE-3 head {head}: " + "; ".join(problems))


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
