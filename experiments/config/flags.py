"""A site's engine flags composed from another site's (the box profile): keep, drop, change or add flags, each
change with its reason. Registered as OmegaConf resolvers by `experiments.config.paths.register_resolvers`:

    ${ws.flags:BASE,CHANGES}          BASE's argv with CHANGES applied
    ${ws.flag_reasons:REASONS,CHANGES} BASE's reasons for the flags kept, CHANGES' for the flags changed or added
    ${ws.flag_value:ARGV,FLAG}        the value FLAG has in ARGV (a list for a flag with several values)

CHANGES = {drop: {FLAG: {reason, link}}, set: {FLAG: {value, reason, link}}}: a set flag that BASE has is replaced
in place, one it lacks is appended; `value` null is a flag without a value, a list is several values. Dropping or
setting a flag is refused when it would be silent: a dropped flag BASE does not have, a change without a reason.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf


class FlagChangeError(ValueError):
    """A change to a base profile's flags that cannot be applied as written."""


def _plain(node):
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig | ListConfig) else node


def split_flags(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """argv as (flag, values) pairs: every '--x' starts a flag, what follows up to the next '--' are its values."""
    pairs: list[tuple[str, list[str]]] = []
    for arg in (str(a) for a in argv):
        if arg.startswith("--"):
            pairs.append((arg, []))
        elif not pairs:
            raise FlagChangeError(f"value {arg!r} before any flag in {list(argv)}")
        else:
            pairs[-1][1].append(arg)
    return pairs


def _values(change: Mapping) -> list[str]:
    value = change.get("value")
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _checked(changes: Mapping) -> tuple[dict, dict]:
    drop, set_ = dict(changes.get("drop") or {}), dict(changes.get("set") or {})
    for flag, change in {**drop, **set_}.items():
        if not str(flag).startswith("--"):
            raise FlagChangeError(f"{flag!r} is not a flag")
        if not isinstance(change, Mapping) or len(str(change.get("reason") or "")) < 20:
            raise FlagChangeError(f"{flag}: every dropped or changed flag needs a reason (one sentence)")
    if both := set(drop) & set(set_):
        raise FlagChangeError(f"{sorted(both)} both dropped and set")
    return drop, set_


def compose_flags(base: Sequence[str], changes: Mapping) -> list[str]:
    """`base` (an engine argv) with `changes` applied, in base's order, added flags last."""
    base, changes = _plain(base), _plain(changes) or {}
    drop, set_ = _checked(changes)
    pairs = split_flags(base)
    if stale := sorted(set(drop) - {f for f, _ in pairs}):
        raise FlagChangeError(f"dropping {stale}: the base profile has no such flag")
    out: list[str] = []
    for flag, values in pairs:
        if flag in drop:
            continue
        out += [flag, *(_values(set_[flag]) if flag in set_ else values)]
    have = {f for f, _ in pairs}
    for flag, change in set_.items():
        if flag not in have:
            out += [flag, *_values(change)]
    return out


def compose_reasons(base_reasons: Mapping, changes: Mapping) -> DictConfig:
    """The reason for every flag the composed argv has: the base's for flags kept as they are, the change's for
    flags changed or added (`from_base` says which base flag each one replaced)."""
    base_reasons, changes = _plain(base_reasons) or {}, _plain(changes) or {}
    drop, set_ = _checked(changes)
    out = {flag: why for flag, why in base_reasons.items() if flag not in drop and flag not in set_}
    for flag, change in set_.items():
        out[flag] = {"reason": change["reason"], "link": change.get("link"),
                     "from_base": "changed" if flag in base_reasons else "added"}
    return OmegaConf.create(out)   # a node, so that `reasons.<flag>.reason` reads as in a site written out


def flag_value(argv: Sequence[str], flag: str) -> str | list[str] | None:
    """The value `flag` has in `argv`: one string, a list for several, None for a flag without a value."""
    for name, values in split_flags(_plain(argv)):
        if name == flag:
            return values[0] if len(values) == 1 else (values or None)
    raise FlagChangeError(f"{flag} is not in {list(_plain(argv))}")


def register() -> None:
    for name, fn in {"ws.flags": compose_flags, "ws.flag_reasons": compose_reasons,
                     "ws.flag_value": flag_value}.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
