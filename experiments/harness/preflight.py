"""Checks that refuse a run before anything is launched, each with a message that says what to do."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from experiments.config.errors import Refused  # noqa: F401  (re-exported for the callers)
from experiments.config.views import RunView
from experiments.engines import adapter_for
from experiments.engines.auth import refuse_key_flags
from experiments.engines.config import available_on_site, forced_patches, given_args, sglang_patches_for
from experiments.engines.knobs import refuse_unused_knobs
from experiments.harness.head_fields import REQUIRED_TO_LOAD, check_head_fields
from experiments.tracking.store_check import check_tracking, check_writable
from sglang_patches import PatchRefused, UnknownPatch
from sglang_patches.requests import check_request

# Any one of these makes a Hugging Face folder's tokenizer loadable (fast, SentencePiece, BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "spiece.model")
ENGINE_PROBE_TIMEOUT_S = 30.0
# NVLink multicast off in every process of a multi-GPU site: on a shared host it can take the GPUs out of service.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


def check_option(run: RunView) -> None:
    """The option runs on this site's engine, with patches, flags and spec settings the engine will use."""
    opt, site = run.option_view, run.site
    if opt.engine and opt.engine not in site.engines:
        hint = f"; option {opt.alternative} runs the same drafter on {site.engines[0]}" if opt.alternative else ""
        if opt.offline:
            hint += f"; on this site it runs offline: {opt.offline}"
        raise Refused(f"option {opt.name} ({opt.title}) needs {opt.engine}, which site "
                      f"{site.name} does not have (it has {site.engines}){hint}")
    if not available_on_site(run):
        raise Refused(f"engine {run.engine} is not available on site {site.name} (it has {site.engines})")
    check_multicast_off(run)
    check_patches(run)
    refuse_key_flags(given_args(run))
    refuse_unused_knobs(run)
    if run.spec.moe_expert_budget is not None:
        check_moe_model(run)
    if run.spec.method == "eagle3" and not run.spec.draft_model:
        raise Refused(f"option {opt.name} needs an EAGLE-3 head for model {run.model.name}, and none is "
                      f"configured (model.drafters.eagle3 is empty): train one with +option=D "
                      f"or set spec.draft_model=/path/to/head")


def check_multicast_off(run: RunView) -> None:
    """A site with more than one GPU must switch NVLink multicast off in NCCL, PyTorch and NVSHMEM, unless it
    says it has no NVLink (`site.nvlink: false`, the PCIe-only box)."""
    site = run.site
    if int(site.gpus or 1) <= 1 or site.nvlink is False:
        return
    wrong = {k: v for k, v in MULTICAST_OFF_ENV.items() if str(site.env.get(k)) != v}
    if wrong:
        raise Refused(f"site {site.name} has {site.gpus} GPUs but does not switch NVLink multicast off: "
                      "set " + ", ".join(f"site.env.{k}={v}" for k, v in wrong.items()))


def check_patches(run: RunView) -> None:
    """The SGLang patches requested meet their own rules (sglang_patches/requests.py): registered, applied by the
    launcher, their conditions on the command line met."""
    try:
        check_request(sglang_patches_for(run), run.engine_start.module, given_args(run), forced_patches(run),
                      run.spec.moe_expert_budget)
    except (UnknownPatch, PatchRefused) as exc:
        raise Refused(exc.args[0] if exc.args else str(exc)) from None


def check_moe_model(run: RunView) -> None:
    """An expert budget needs routed experts: a model whose config.json is here and has none is refused by name
    (a model not on this machine, e.g. the box's Kimi-K2.5 from here, is checked where it is served)."""
    from sglang_patches.moe_budget import refuse_unless_moe

    config = Path(run.model.path) / "config.json"
    if config.exists():
        try:
            refuse_unless_moe(read_config(config, f"model {run.model.name}"))
        except PatchRefused as exc:
            raise Refused(f"option {run.option} needs a MoE model; model {run.model.name}: {exc} "
                          f"(the small MoE: model=tiny_moe_dsv3)") from None


def read_config(path: Path, what: str) -> dict:
    """A config.json as a JSON object; a file that cannot be read, is not JSON or holds no object is refused naming
    the file (and where its JSON breaks)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise Refused(f"{what}: {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                      "fix or replace the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Refused(f"{what}: cannot read {path} ({exc}); fix or replace the file") from None
    if not isinstance(data, dict):
        raise Refused(f"{what}: {path} holds {JSON_KINDS.get(type(data), 'a JSON value')}, not a JSON object; "
                      "fix or replace the file")
    return data


def check_inputs(run: RunView) -> None:
    """What every runner reads, before the workload is read and before any engine check (dry runs included): a
    model folder and an EAGLE-3 head that are here are complete and fit, the tracking store and the folders the
    run writes can be written."""
    if Path(run.model.path).exists():   # a model not here (the box's, checked from here) is checked where served
        check_model_folder(run)
    if not run.option_view.evaluate_as:   # an option that trains its head (D) has none yet
        check_head(run, required=not run.run.dry_run)
    check_tracking(run.tracking)
    check_output_dir()


def _model_fix(run: RunView) -> str:
    return ("run `bin/setup` (python -m experiments.hosts.setup_embedded) once" if run.model.embedded
            else f"set model.path (or its environment variable) to the folder of {run.model.hf_id}")


def check_model_folder(run: RunView) -> None:
    model, name = Path(run.model.path), run.model.name
    if not (model / "config.json").is_file():
        raise Refused(f"model {name}: no Hugging Face folder at {model} (no config.json); {_model_fix(run)}")
    if not any((model / f).is_file() for f in TOKENIZER_FILES) and not any(model.glob("*.tiktoken")):
        raise Refused(f"model {name}: {model} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                      f"{_model_fix(run)}")
    read_config(model / "config.json", f"model {name}")


def check_engine_env(run: RunView) -> None:
    """The engine's interpreter exists and imports the engine (dry runs included: its parser checks the command
    line); a bare `python3` counts as set up when this interpreter imports the engine, as the engines then use it."""
    engine, python = run.engine, run.engine_start.python
    fix = "run `bin/setup` once" if run.model.embedded else f"set engine.python to an interpreter with {engine}"
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


def check_output_dir() -> None:
    """The Hydra job's output folder (records, server log) can be written; no Hydra (an API caller), no check."""
    if not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    key = "hydra.sweep.dir" if hydra.mode == RunMode.MULTIRUN else "hydra.run.dir"
    check_writable(Path(hydra.runtime.output_dir), f"the run's output folder ({key})",
                    f"set {key} to a writable folder")


def check_assets(run: RunView) -> None:
    check_model_folder(run)
    check_head(run)
    check_engine_env(run)


def check_head(run: RunView, required: bool = True) -> None:
    """An EAGLE-3 head exists, parses, fits the target (when the target is here) and the engine can load it; a
    head that is not here passes when not `required` (a dry run: the box's head is checked where it is served)."""
    if run.spec.method != "eagle3":
        return
    head = Path(str(run.spec.draft_model))
    if not required and not head.exists():
        return
    if not (head / "config.json").exists():
        raise Refused(f"EAGLE-3 head not found at {head}: train one with +option=D "
                      f"(it is saved there) or set spec.draft_model=/path/to/head")
    model = Path(run.model.path)
    if (model / "config.json").exists():
        check_head_fits(head, model)
    check_head_loads(run.engine, head)


def check_head_loads(engine: str, head: Path) -> None:
    """Refused when the engine cannot load the head's config.json as it is: a field it reads missing or of the
    wrong kind (head_fields), or what the engine itself cannot take (EngineAdapter.head_config_problems)."""
    config = read_config(head / "config.json", f"EAGLE-3 head {head}")
    check_head_fields(config, head / "config.json", REQUIRED_TO_LOAD)
    problems = adapter_for(engine).head_config_problems(config)
    if problems:
        raise Refused(f"{engine} cannot load EAGLE-3 head {head}: " + "; ".join(problems))


def check_head_fits(head: Path, model: Path) -> None:
    """An EAGLE-3 head must match its target: hidden size, vocabulary, aux layers inside its depth."""
    h = read_config(head / "config.json", f"EAGLE-3 head {head}")
    check_head_fields(h, head / "config.json", ("vocab_size",) if "target_hidden_size" in h else
                      ("hidden_size", "vocab_size"))
    t = read_config(model / "config.json", f"target model {model}")
    t = t.get("text_config", t)
    lacking = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if not isinstance(t.get(k), int)]
    if lacking:
        raise Refused(f"target model {model}: {model / 'config.json'} has no integer {', '.join(lacking)}; "
                      "fix or replace the file")
    problems = []
    if h.get("target_hidden_size", h.get("hidden_size")) != t["hidden_size"]:
        problems.append(f"hidden size {h.get('target_hidden_size', h.get('hidden_size'))} vs the target's "
                        f"{t['hidden_size']}")
    if h.get("vocab_size") != t["vocab_size"]:
        problems.append(f"vocabulary {h.get('vocab_size')} vs the target's {t['vocab_size']}")
    ids = (h.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    beyond = [i for i in ids if not 0 <= i < t["num_hidden_layers"]]
    if beyond:
        problems.append(f"aux layer ids {beyond} beyond the target's {t['num_hidden_layers']} layers")
    if problems:
        raise Refused(f"EAGLE-3 head {head} does not fit target {model}: " + "; ".join(problems))
