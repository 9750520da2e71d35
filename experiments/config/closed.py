"""Closed config groups: every key a run is given must be declared by a config file. A key added on the command
line (`+workload.request_rate=2`) or misspelt in a file (`max_token: 64` in your own workload yaml) would otherwise
be dropped without a word, as the stages read the keys they know; it is refused before anything starts, naming
the nearest declared key.

Where the keys are declared: a group with a `_base.yaml` (workload) by that file alone, so a workload file cannot
add a key of its own; the root and its blocks (`spec`, `limits`, `server`, `baseline`, `run`) by
conf/config.yaml plus what the option and site overlays (`# @package _global_`) set; a group without a base
(model, engine, site, tracking) by the union of its files. The blocks in OPEN are free-form by design. The check
is OmegaConf's own struct mode: the declared keys, every value null, made a struct config and merged with the
run's keys. Hydra refuses an override of an undeclared key without `+` by itself ("Could not override"), earlier."""
from __future__ import annotations

import difflib
import re
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from experiments.config.errors import Refused
from experiments.config.paths import ROOT

CONF = ROOT / "conf"
GLOBAL_PACKAGE = re.compile(r"^#\s*@package\s+_global_\s*$", re.MULTILINE)
# free-form by design (dotted from the root): Hydra's own block (compose(return_hydra_config=True)), variables,
# tags, a model's own description, the reasons and flag edits a site documents, and the site profiles h200-kimi
# composes under `profiles`
OPEN = ("hydra", "engine.env", "site.env", "run.tags", "model.hf_config", "model.eagle3_drafters", "model.source",
        "site.reasons", "site.flag_changes", "profiles")
# read by the code, set by no site file: a run adds it on the command line (+site.patches_forced=[...])
ADDED_ON_THE_COMMAND_LINE = {"site": {"patches_forced": None}}


def check_composed(cfg: DictConfig) -> None:
    """Before the config is typed: every key declared (first: a misspelt key explains whatever else looks wrong),
    an option chosen, and the option names its runner."""
    refuse_unknown_keys(cfg)
    option = cfg.get("option")
    if option is None:
        raise Refused("choose an experiment with +option=X, X one of baseline, A, B, C, D, E (conf/option/)")
    if not OmegaConf.select(option, "runner._target_"):
        raise Refused(f"option {option.name} names no runner (option.runner._target_ in "
                      f"conf/option/{option.name}.yaml)")


def refuse_unknown_keys(cfg: DictConfig) -> None:
    """Raise Refused naming the first key of `cfg` that no config file declares, and the nearest declared one."""
    schema = OmegaConf.create(declared_keys())
    OmegaConf.set_struct(schema, True)
    for path in OPEN:
        node = OmegaConf.select(schema, path)
        if isinstance(node, DictConfig):
            OmegaConf.set_struct(node, False)
    try:
        OmegaConf.merge(schema, _keys(OmegaConf.to_container(cfg, resolve=False)))
    except ConfigKeyError as exc:
        raise Refused(_message(str(exc.full_key), declared_keys())) from None


def refuse_unknown_overrides(args: list[str]) -> None:
    """Command-line overrides of keys no config file declares (`workload.concurency=[1]`, without `+`), refused
    naming the nearest declared key before Hydra composes (which would only say it cannot override the key).
    Additions (`+`, `++`), deletions, group paths and what Hydra cannot parse are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, tree = OverridesParser.create(), declared_keys()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException:
            continue
        if override.is_add() or override.is_force_add() or override.is_delete() or override.package is not None:
            continue
        unknown = _undeclared(override.key_or_group, tree)
        if unknown:
            raise Refused(_message(unknown, tree))


def _undeclared(key: str, tree: dict) -> str | None:
    """The first prefix of dotted `key` that `tree` does not declare; None when it does, or the key reaches a
    leaf, a group path or a free-form block first (not this check's to judge)."""
    if "/" in key:
        return None
    node: object = tree
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or ".".join(parts[:i]) in OPEN:
            return None
        if part not in node:
            return ".".join(parts[:i + 1])
        node = node[part]
    return None


@cache
def declared_keys() -> dict:
    """Every declared key as a tree of dicts, each value None (see the module docstring for the sources)."""
    tree = _keys(_load(CONF / "config.yaml"))
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml")).get("defaults", [])
    for entry in [e for e in defaults if isinstance(e, dict)]:
        name = next(iter(entry)).removeprefix("optional ").strip()
        folder = CONF / name
        base = folder / "_base.yaml"
        for path in [base] if base.exists() else sorted(folder.glob("*.yaml")):
            data = _keys(_load(path))
            _union(tree, data if _is_global(path) else {name: data})
    for path in sorted((CONF / "option").glob("*.yaml")):
        _union(tree, _keys(_load(path)))
    _union(tree, ADDED_ON_THE_COMMAND_LINE | {"hydra": {}})
    return tree


def _load(path: Path) -> dict:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    return {k: v for k, v in data.items() if k not in ("defaults", "hydra")}


def _is_global(path: Path) -> bool:
    return bool(GLOBAL_PACKAGE.search(path.read_text()))


def _keys(data: object) -> object:
    """The keys of a container, nested, every value None."""
    if isinstance(data, dict):
        return {str(k): _keys(v) for k, v in data.items()}
    return None


def _union(into: dict, other: dict) -> None:
    for key, value in other.items():
        if isinstance(value, dict):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _union(into[key], value)
        else:
            into.setdefault(key, None)


def _message(full_key: str, tree: dict) -> str:
    parent, _, key = full_key.rpartition(".")
    siblings = OmegaConf.select(OmegaConf.create(tree), parent) if parent else tree
    names = sorted(siblings or {})
    where = f"{parent}." if parent else ""
    near = nearest(key, names)
    hint = f"did you mean {where}{near}?" if near else f"the {parent or 'top-level'} keys: {', '.join(names)}"
    return (f"unknown setting {full_key}: no config file declares it, so no stage would read it; {hint} "
            f"({_source(full_key)})")


def nearest(key: str, names: list[str]) -> str | None:
    """The declared name nearest to `key` (difflib), also comparing each run of its words with the names, so that
    `request_rate` finds `rate` rather than `request_timeout_s`."""
    words = key.split("_")
    parts = {"_".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
    scored = [(max(difflib.SequenceMatcher(None, p, n).ratio() - (p != key) * 0.05 for p in parts), n)
              for n in names]
    best = max(scored, default=(0.0, None))
    return best[1] if best[0] >= 0.6 else None


def _source(full_key: str) -> str:
    top = full_key.split(".", 1)[0]
    if (CONF / top / "_base.yaml").exists():
        return f"the {top} keys are declared in conf/{top}/_base.yaml"
    if (CONF / top).is_dir():
        return f"the {top} keys are those of conf/{top}/*.yaml"
    return "the keys are declared in conf/config.yaml and the option and site overlays"
