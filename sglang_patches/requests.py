"""What a launch's requested patches must meet before anything starts: every name registered, the launcher that
applies them, and each patch's own conditions on the command line (random weights for the synthetic router, no CUDA
graphs for the expert telemetry, a positive expert budget). The workspace's preflight calls `check_request`."""
from __future__ import annotations

from collections.abc import Sequence

from sglang_patches import PatchRefused, resolve

LAUNCHER = "sglang_patches.launch"


def flag_is(args: Sequence[str], flag: str, value: str) -> bool:
    """`flag value` or `flag=value` among `args`."""
    return any(a == flag and i + 1 < len(args) and args[i + 1] == value for i, a in enumerate(args)) or \
        f"{flag}={value}" in args


def check_request(patches: Sequence[str], module: str, args: Sequence[str], forced: Sequence[str],
                  budget: int | None) -> None:
    """Raise UnknownPatch for a name no module registers, PatchRefused for a request the patches cannot serve:
    `module` is the engine's entry module, `args` the flags given as they are, `forced` the patches applied whatever
    their conditions say, `budget` the expert budget the moe_budget patch reads."""
    patches = list(patches)
    resolve(patches)
    if patches and module != LAUNCHER:
        raise PatchRefused(f"patches {patches} need engine.module={LAUNCHER} (it is {module})")
    if "synthetic_router" in patches and not flag_is(args, "--load-format", "dummy"):
        raise PatchRefused("model.moe.router_skew replaces the router's logits (synthetic_router): only for a model "
                           "served with random weights (--load-format dummy); set model.moe.router_skew=null to "
                           "serve real weights")
    if unrequested := [n for n in forced if n not in patches]:
        raise PatchRefused(f"site.patches_forced {unrequested} are not among the patches applied {patches}: "
                           "add them to site.patches")
    if "moe_budget" in patches and not (isinstance(budget, int) and budget >= 1):
        raise PatchRefused(f"spec.moe_expert_budget must be a positive integer, got {budget!r}")
    if "expert_telemetry" in patches and "--disable-cuda-graph" not in args:
        raise PatchRefused("spec.moe_telemetry=true counts experts in Python, which CUDA-graph replays skip: add "
                           "'engine.extra_args=[--disable-cuda-graph]' (the baseline then runs without graphs too)")
