"""`python -m sglang_patches.launch <sglang server args>`: apply the patches named in SPECWS_SGLANG_PATCHES in
this process and in every process SGLang spawns, report them, run the INT4 MoE kernel self-check, then hand
over to SGLang's own entry point (`sglang.launch_server`, same argv).

How the patches reach SGLang's workers: SGLang starts its scheduler/TP/detokenizer processes with
multiprocessing "spawn". A spawned child first re-imports the parent's `__main__` module by name (as
`__mp_main__`) before it unpickles its target; the parent's main module is this one, because the hand-over
runs SGLang's entry module without replacing `sys.modules["__main__"]`. So every spawned child runs the
`__mp_main__` branch below and applies the same patches before any SGLang code runs in it. The launcher
decides which patches are active (conditions need the device and the server args) and passes the decision
to the children in SPECWS_SGLANG_PATCHES_ACTIVE.

Environment: SPECWS_SGLANG_PATCHES (comma-separated names), SPECWS_SGLANG_SELFCHECK (auto | required | off;
auto runs it when a CUDA device is present and the checkpoint is INT4 weight-only), SPECWS_SITE,
SPECWS_SGLANG_ENTRY (the module handed over to; default sglang.launch_server), SPECWS_SGLANG_PATCHES_FORCED
(names among the requested whose conditions are bypassed, e.g. the SM 12.x kernel swap measured on sm_90).
Every process writes one `SPECWS_SGLANG_PATCHES_REPORT {json}` line to stderr (the server log).
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from packaging.version import Version

from sglang_patches import Context, PatchRefused, UnknownPatch, resolve
from sglang_patches.applying import REPORT_PREFIX, apply_patches, emit, process_identity, select, sglang_version

PATCHES_ENV = "SPECWS_SGLANG_PATCHES"
ACTIVE_ENV = "SPECWS_SGLANG_PATCHES_ACTIVE"
SELFCHECK_ENV = "SPECWS_SGLANG_SELFCHECK"
ENTRY_ENV = "SPECWS_SGLANG_ENTRY"
FORCED_ENV = "SPECWS_SGLANG_PATCHES_FORCED"
EXIT_REFUSED, EXIT_SELFCHECK = 2, 3


def launcher_env(patches: list[str], site: str, pythonpath: str | None,
                 forced: list[str] | None = None) -> dict[str, str]:
    """Environment the workspace gives the launcher: the patch names (and those forced past their conditions),
    the site, and this workspace on PYTHONPATH ahead of what is there already (SGLang may itself come from
    PYTHONPATH, as on the H200)."""
    root = str(Path(__file__).resolve().parent.parent)
    paths = [root, *[p for p in (pythonpath or "").split(os.pathsep) if p and p != root]]
    env = {PATCHES_ENV: ",".join(patches), "SPECWS_SITE": site, "PYTHONPATH": os.pathsep.join(paths)}
    return env | ({FORCED_ENV: ",".join(forced)} if forced else {})


def names_from_env(var: str) -> list[str]:
    return [n.strip() for n in os.environ.get(var, "").split(",") if n.strip()]


def server_args(argv: list[str]):
    """SGLang's own parser over the server argv (parse_known_args: nothing resolved, nothing fetched)."""
    import argparse

    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    try:
        return parser.parse_known_args(argv)[0]
    except SystemExit:
        return None


def checkpoint_config(model_path: str | None) -> dict:
    path = Path(model_path or "") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def quantization_config(config: dict) -> dict:
    """Top level, or inside text_config for multimodal checkpoints."""
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}


def is_int4_weight_only(config: dict) -> bool:
    """compressed-tensors with 4-bit weights and no activation quantisation (Kimi-K2.5's INT4)."""
    q = quantization_config(config)
    groups = (q.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("num_bits") == 4 and not g.get("input_activations") for g in groups)


def detect_context(argv: list[str]) -> tuple[Context, object, dict]:
    import torch
    ns = server_args(argv)
    config = checkpoint_config(getattr(ns, "model_path", None))
    quant = getattr(ns, "quantization", None) or quantization_config(config).get("quant_method")
    capability = tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    ctx = Context(capability=capability, quantization=quant, site=os.environ.get("SPECWS_SITE"),
                  model_type=config.get("model_type"))
    return ctx, ns, config


def selected_moe_kernel(ns, ctx: Context, applied: list[str]) -> str:
    """The W4A16 MoE kernel SGLang will run for a compressed-tensors INT4 checkpoint."""
    backend = str(getattr(ns, "moe_runner_backend", "auto") or "auto")
    if backend == "triton" or "sm12x_wna16_moe_triton" in applied:
        return "triton_w4a16"
    if backend == "auto" and ctx.capability and ctx.capability[0] == 10 and \
            Version(sglang_version()) >= Version("0.5.23"):
        return "triton_w4a16"   # SGLang's SM100/103 auto default (in 0.5.23, not in 0.5.14)
    return "marlin_w4a16"


def with_fallback(refusal: str, kernel: str) -> str:
    """A refusal of SGLang's default Marlin kernel names the opt-in Triton fallback and its measured cost."""
    if kernel != "marlin_w4a16":
        return refusal
    return (f"{refusal}; fallback: serve with site.patches=[sm12x_wna16_moe_triton] (Triton W4A16: ~5-6x slower "
            "per MoE call than Marlin, 3.5-6.4x over M = 1-512, as measured on sm_90)")


def run_selfcheck(ns, ctx: Context, config: dict, applied: list[str]) -> dict:
    import torch

    from sglang_patches import selfcheck
    mode = os.environ.get(SELFCHECK_ENV, "auto")
    if mode == "off":
        return {"status": "off"}
    if mode == "auto" and not (torch.cuda.is_available() and is_int4_weight_only(config)):
        return {"status": "skipped", "reason": "no CUDA device or not an INT4 weight-only checkpoint"}
    kernel = selected_moe_kernel(ns, ctx, applied)
    report = selfcheck.run()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()   # give the check's memory back before SGLang sizes its pools
    report["selected"] = kernel
    reasons = [r for p in report["problems"] if (r := selfcheck.refusal(p["results"], [kernel]))]
    reasons = [with_fallback(r, kernel) for r in reasons]
    if report.get("skipped"):
        reasons.append(f"INT4 MoE kernel self-check could not run: {report['skipped']}")
    report["status"] = "refused" if reasons else "pass"
    report["refusal"] = reasons[0] if reasons else None
    return report


def launch(argv: list[str]) -> int:
    names = names_from_env(PATCHES_ENV)
    record = {"role": "launcher", **process_identity(), "requested": names}
    try:
        patches = resolve(names)
        record["sglang_version"] = sglang_version()
        ctx, ns, config = detect_context(argv)
        record["context"] = {k: v for k, v in vars(ctx).items()}
        record["forced"] = names_from_env(FORCED_ENV)
        active, record["skipped"] = select(patches, ctx, record["forced"])
        record["applied"] = apply_patches(active, record["sglang_version"])
    except (UnknownPatch, PatchRefused) as exc:
        record["refused"] = str(exc)
        emit(REPORT_PREFIX, record)
        print(f"sglang_patches: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    applied = [r["name"] for r in record["applied"]]
    os.environ[ACTIVE_ENV] = ",".join(applied)
    check = run_selfcheck(ns, ctx, config, applied)
    record["selfcheck"] = {k: check.get(k) for k in ("status", "reason", "selected", "refusal", "summary")}
    emit(REPORT_PREFIX, record)
    if check.get("status") == "refused":
        print(check["refusal"], file=sys.stderr)
        return EXIT_SELFCHECK
    entry = os.environ.get(ENTRY_ENV, "sglang.launch_server")
    sys.argv = [entry, *argv]
    # alter_sys=False keeps this module as __main__, which is what makes spawned children re-import it.
    runpy.run_module(entry, run_name="__main__", alter_sys=False)
    return 0


def apply_in_spawned_child() -> None:
    """A process SGLang spawned: apply what the launcher applied, before SGLang's code runs here."""
    names = names_from_env(ACTIVE_ENV)
    if not names:
        return
    record = {"role": "spawned", **process_identity(), "sglang_version": sglang_version()}
    try:
        record["applied"] = apply_patches(resolve(names), record["sglang_version"])
    except (UnknownPatch, PatchRefused) as exc:
        record["refused"] = str(exc)
        emit(REPORT_PREFIX, record)
        raise
    emit(REPORT_PREFIX, record)


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
elif __name__ == "__mp_main__":
    apply_in_spawned_child()
