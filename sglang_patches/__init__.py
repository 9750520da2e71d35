"""Guarded, versioned, reported patches that adapt SGLang to SM120 and INT4 (see design.md).

This is the registry only; the patches, the launcher that applies them in every SGLang process and the
INT4 MoE kernel self-check arrive with issue 4. A site names the patches it wants in `site.patches`;
an unknown name is refused before anything is launched.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Patch:
    name: str
    fixes: str                 # what it fixes and why, with the SGLang issue link
    sglang_versions: str       # PEP 440 specifier of the releases it was written for
    applies_when: str          # condition: compute capability, quantization, site
    targets: tuple[str, ...] = field(default_factory=tuple)  # "module:attribute" it replaces


REGISTRY: dict[str, Patch] = {}


class UnknownPatch(KeyError):
    pass


def resolve(names: list[str]) -> list[Patch]:
    """The patches named by a site, refusing unknown names all at once (nothing half-selected)."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UnknownPatch(f"unknown sglang_patches {unknown}; registered: {sorted(REGISTRY)}")
    return [REGISTRY[n] for n in names]
