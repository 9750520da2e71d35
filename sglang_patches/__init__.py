"""Guarded, versioned, reported patches that adapt SGLang to SM120 and INT4 (see design.md).

API (adding a patch = one module with one `register(Patch(...))`, listed in PATCH_MODULES below):

    from sglang_patches import Patch, When, register

    def _apply(t):                       # t: Targets, every target already resolved
        original = t.get("sglang.srt.x:f")
        t.replace("sglang.srt.x:f", lambda *a, **k: original(*a, **k))

    register(Patch(
        name="my_patch", fixes="what and why", link="https://github.com/sgl-project/sglang/issues/N",
        sglang_versions=">=0.5.14,<0.6", when=When(capability_major=(12,)),
        targets=("sglang.srt.x:f",), apply=_apply))

- `when` is the activation condition (compute capability major, quantization, site, model type); a patch
  whose condition does not hold is reported as skipped, not applied.
- Applying is all-or-nothing (`sglang_patches.applying.apply_patches`): the SGLang version is checked
  against every patch's specifier and every target ("module:attribute") is resolved before anything is
  replaced; a version outside a specifier or a missing target is refused by name and nothing is applied.
  A failure inside an `apply` rolls back every replacement made so far.
- `check(t)` says whether the patch is in place; the default checks that every replaced target still
  holds its replacement.
- The launcher (`python -m sglang_patches.launch <sglang args>`) applies the named patches in its own
  process and in every process SGLang spawns, reports them, runs the INT4 MoE kernel self-check and
  hands over to `sglang.launch_server`.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PATCH_MODULES: tuple[str, ...] = (
    "sglang_patches.marker",
    "sglang_patches.sm12x_wna16_moe",
    "sglang_patches.synthetic_router",    # random-weight MoE models: routing before the budget and telemetry
    "sglang_patches.moe_budget",          # option E: MoE-Spec expert budget (before expert_telemetry)
    "sglang_patches.expert_telemetry",    # option E: distinct experts per layer per forward
)


@dataclass(frozen=True)
class Context:
    """What activation conditions look at, detected in the launcher process."""
    capability: tuple[int, int] | None = None   # CUDA compute capability of device 0, None without CUDA
    quantization: str | None = None             # --quantization or the checkpoint's quant_method
    site: str | None = None
    model_type: str | None = None               # config.json model_type (kimi_k25, deepseek_v3, llama...)


@dataclass(frozen=True)
class When:
    """Activation condition; an empty tuple means "any"."""
    capability_major: tuple[int, ...] = ()
    quantization: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    def skip_reason(self, ctx: Context) -> str | None:
        """None when the patch is active in `ctx`, otherwise why it is skipped."""
        if self.capability_major:
            if ctx.capability is None:
                return f"needs compute capability {self.capability_major}.x, no CUDA device"
            if ctx.capability[0] not in self.capability_major:
                return f"needs compute capability {self.capability_major}.x, device is {ctx.capability}"
        checks = (("quantization", self.quantization, ctx.quantization), ("site", self.sites, ctx.site),
                  ("model type", self.model_types, ctx.model_type))
        for what, wanted, actual in checks:
            if wanted and actual not in wanted:
                return f"needs {what} in {list(wanted)}, got {actual!r}"
        return None

    def describe(self) -> str:
        parts = [f"capability {'/'.join(f'{m}.x' for m in self.capability_major)}" if self.capability_major else "",
                 f"quantization {list(self.quantization)}" if self.quantization else "",
                 f"site {list(self.sites)}" if self.sites else "",
                 f"model type {list(self.model_types)}" if self.model_types else ""]
        return ", ".join(p for p in parts if p) or "always"


class Targets:
    """Resolved targets of one patch: read the originals, replace attributes (undoable)."""

    def __init__(self, resolved: dict[str, tuple[Any, str, Any]]):
        self._resolved = resolved                  # target -> (owner object, attribute, original value)
        self.replaced: dict[str, Any] = {}
        # As stored on the owner (a classmethod object, not the bound method getattr gives): what undo restores.
        self._stored = {k: inspect.getattr_static(owner, attr) for k, (owner, attr, _) in resolved.items()}

    def get(self, target: str) -> Any:
        """The original value as `getattr` gives it (bound for class/static methods)."""
        return self._resolved[target][2]

    def replace(self, target: str, new: Any) -> None:
        owner, attr, _ = self._resolved[target]
        setattr(owner, attr, new)
        self.replaced[target] = new

    def current(self, target: str) -> Any:
        owner, attr, _ = self._resolved[target]
        return inspect.getattr_static(owner, attr)

    def undo(self) -> None:
        for target in list(self.replaced):
            owner, attr, _ = self._resolved[target]
            setattr(owner, attr, self._stored[target])
            del self.replaced[target]


def _replacements_in_place(t: Targets) -> bool:
    return bool(t.replaced) and all(t.current(k) is v for k, v in t.replaced.items())


@dataclass(frozen=True)
class Patch:
    name: str
    fixes: str                 # what it fixes and why
    link: str                  # the SGLang issue / PR it answers
    sglang_versions: str       # PEP 440 specifier of the releases it was written for
    when: When
    targets: tuple[str, ...]   # "module:attribute" (attribute may be dotted: "module:Class.method")
    apply: Callable[[Targets], None]
    check: Callable[[Targets], bool] = field(default=_replacements_in_place)

    @property
    def applies_when(self) -> str:
        return self.when.describe()


REGISTRY: dict[str, Patch] = {}


class UnknownPatch(KeyError):
    pass


class PatchRefused(RuntimeError):
    """A patch cannot be applied as asked (version, missing target, failing apply); nothing was applied."""


def register(patch: Patch) -> Patch:
    if patch.name in REGISTRY and REGISTRY[patch.name] is not patch:
        raise ValueError(f"sglang patch {patch.name!r} registered twice")
    REGISTRY[patch.name] = patch
    return patch


def resolve(names: list[str]) -> list[Patch]:
    """The patches named by a site, refusing unknown names all at once (nothing half-selected)."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UnknownPatch(f"unknown sglang_patches {unknown}; registered: {sorted(REGISTRY)}")
    return [REGISTRY[n] for n in names]


for _module in PATCH_MODULES:
    importlib.import_module(_module)
