"""A plan's knobs as keys of a typed settings object: `key=value` arguments parsed into the plan's dataclass (its
field defaults are the plan's defaults), an unknown key or a value of the wrong type refused before anything runs.
Types understood: str, int, float, bool (true/false, 1/0, yes/no), a Literal of strings, and tuple[str, ...]
(shell words: `overrides="a=1 b=2"`)."""
from __future__ import annotations

import dataclasses
import shlex
import typing
from collections.abc import Sequence
from typing import Any

TRUE, FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


class KnobError(ValueError):
    """An argument the plan does not take, or a value its key cannot hold."""


def parse_knobs(cls: type, args: Sequence[str]) -> Any:
    """The settings of `cls` with each `key=value` of args applied in order (a later one wins); arguments after
    `--` are appended to the `overrides` key as they are."""
    args = list(args)
    tail: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, tail = args[:cut], args[cut + 1:]
    types = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise KnobError(f"{arg!r}: expected key=value (keys: {', '.join(names)}; Hydra overrides after --)")
        if key not in names:
            raise KnobError(f"unknown key {key!r} (keys: {', '.join(names)}; Hydra overrides after --)")
        values[key] = convert(key, raw, types[key])
    if tail:
        if "overrides" not in names:
            raise KnobError(f"this plan takes no overrides (after --): {' '.join(tail)}")
        values["overrides"] = tuple(values.get("overrides", ())) + tuple(tail)
    try:
        return cls(**values)
    except ValueError as e:
        raise KnobError(str(e)) from e


def convert(key: str, raw: str, kind: Any) -> Any:
    """raw as the type `kind` of key, or KnobError."""
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        if raw not in typing.get_args(kind):
            raise KnobError(f"{key}={raw!r}: one of {', '.join(typing.get_args(kind))}")
        return raw
    if origin is tuple:
        return tuple(shlex.split(raw))
    if kind is bool:
        if raw.lower() not in TRUE | FALSE:
            raise KnobError(f"{key}={raw!r}: true or false")
        return raw.lower() in TRUE
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise KnobError(f"{key}={raw!r}: not {'an integer' if kind is int else 'a number'}") from None
    if kind is str:
        return raw
    raise KnobError(f"{key}: a key of type {kind} cannot be set from the command line")


def describe(settings: Any) -> str:
    """key=value of every setting, for the plan's log."""
    parts = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        parts.append(f"{f.name}={shlex.join(value) if isinstance(value, tuple) else value}")
    return " ".join(parts)
