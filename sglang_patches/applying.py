"""All-or-nothing application of registered patches in the current process, and its report."""
from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sglang_patches import Context, Patch, PatchRefused, Targets

REPORT_PREFIX = "SPECWS_SGLANG_PATCHES_REPORT "   # one line per process in the server log
EVENT_PREFIX = "SPECWS_SGLANG_PATCHES_EVENT "     # lines written by patched code when it runs

# Targets of patches applied in this process, kept so that `check` can be asked later.
APPLIED: dict[str, Targets] = {}


def sglang_version() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        import sglang
        return str(getattr(sglang, "__version__", "0"))


def resolve_target(target: str) -> tuple[object, str, object]:
    """"module:attr.sub" -> (owner, attribute name, current value); raises LookupError naming what is missing."""
    module_name, _, path = target.partition(":")
    if not path:
        raise LookupError(f"target {target!r} is not of the form 'module:attribute'")
    try:
        owner: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"module {module_name} cannot be imported ({exc})") from None
    *parents, attr = path.split(".")
    for name in parents:
        if not hasattr(owner, name):
            raise LookupError(f"{module_name} has no {name!r}")
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise LookupError(f"{module_name}:{'.'.join(parents) + '.' if parents else ''}{attr} does not exist")
    return owner, attr, getattr(owner, attr)


def select(patches: list[Patch], ctx: Context, forced: Sequence[str] = ()) -> tuple[list[Patch], list[dict]]:
    """Split into active patches and skipped ones (with the reason); a `forced` one is active whatever its
    conditions say, and a forced name that is not among `patches` is refused (a knob that would do nothing)."""
    names = [p.name for p in patches]
    if unknown := [f for f in forced if f not in names]:
        raise PatchRefused(f"forced patches {unknown} are not among the requested {names}")
    active, skipped = [], []
    for p in patches:
        reason = None if p.name in forced else p.when.skip_reason(ctx)
        if reason is None:
            active.append(p)
        else:
            skipped.append({"name": p.name, "reason": reason})
    return active, skipped


def apply_patches(patches: list[Patch], version: str | None = None) -> list[dict]:
    """Apply `patches` in this process, all or nothing. Returns one record per applied patch."""
    version = version or sglang_version()
    refusals = [f"{p.name}: written for sglang{p.sglang_versions}, installed is {version}"
                for p in patches if not SpecifierSet(p.sglang_versions).contains(Version(version), prereleases=True)]
    resolved: dict[str, dict[str, tuple]] = {}
    for p in patches:
        resolved[p.name] = {}
        for target in p.targets:
            try:
                resolved[p.name][target] = resolve_target(target)
            except LookupError as exc:
                refusals.append(f"{p.name}: target {target} missing in sglang {version}: {exc}")
    if refusals:
        raise PatchRefused("refused, nothing applied: " + "; ".join(refusals))
    done: list[tuple[Patch, Targets]] = []
    try:
        for p in patches:
            targets = Targets(resolved[p.name])
            done.append((p, targets))
            p.apply(targets)
            if not p.check(targets):
                raise PatchRefused(f"{p.name}: applied but its check fails")
    except Exception as exc:
        for _, targets in reversed(done):
            targets.undo()
        if isinstance(exc, PatchRefused):
            raise PatchRefused(f"refused, nothing applied: {exc}") from exc
        raise PatchRefused(f"refused, nothing applied: {done[-1][0].name}: apply failed: {exc!r}") from exc
    records = []
    for p, targets in done:
        APPLIED[p.name] = targets
        records.append({"name": p.name, "sglang_versions": p.sglang_versions, "targets": list(p.targets),
                        "check": bool(p.check(targets)), "link": p.link})
    return records


def process_identity() -> dict:
    return {"pid": os.getpid(), "process": multiprocessing.current_process().name,
            "parent_pid": os.getppid()}


def emit(prefix: str, payload: dict) -> None:
    """One JSON line on stderr (SGLang's processes share the server log)."""
    sys.stderr.write(prefix + json.dumps(payload, sort_keys=True) + "\n")
    sys.stderr.flush()


def parse_log(text: str) -> dict:
    """The launcher's report lines and patch events found in a server log."""
    reports, events = [], []
    for line in text.splitlines():
        for prefix, into in ((REPORT_PREFIX, reports), (EVENT_PREFIX, events)):
            at = line.find(prefix)
            if at >= 0:
                try:
                    into.append(json.loads(line[at + len(prefix):]))
                except json.JSONDecodeError:
                    pass
    launcher = next((r for r in reports if r.get("role") == "launcher"), None)
    return {"launcher": launcher, "processes": reports, "events": events}


def applied_tag(parsed: dict) -> str:
    """`name@sglang-version` of what the launcher applied, for the run's `sglang_patches.applied` tag."""
    launcher = parsed.get("launcher")
    if launcher is None:
        return "no launcher report"
    if launcher.get("refused"):
        return "refused: " + str(launcher["refused"])[:400]
    names = [r["name"] for r in launcher.get("applied", [])]
    return ",".join(f"{n}@sglang{launcher.get('sglang_version')}" for n in names) or "none"
