"""The analysis's vocabulary in words, one way everywhere (report, recommendation, console): an option configuration
("A: n-gram, 4 draft tokens", "B: EAGLE-3, 3 steps"), a set of load levels ("c = 1 and 4"), a workload (its name,
the prompt set it sends in parentheses where that is another name), and the defaults a configuration got from its
option and engine rather than from the person who ran it."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass
from functools import cache
from typing import Any

from experiments.config.paths import ROOT

METHODS = {"ngram": "n-gram", "eagle3": "EAGLE-3", "none": "no speculation"}
MIN_PROMPTS = 32      # prompts per level below which a verdict is not one to decide on
FEW_PROMPTS = "too few prompts to decide on"


def _spec(spec: Any) -> dict[str, Any]:
    """A spec as a dict: a SpecView (or any dataclass) or a mapping (a Candidate's spec)."""
    return asdict(spec) if is_dataclass(spec) else dict(spec or {})


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


@cache
def engine_window(engine: str | None) -> tuple[Any, Any]:
    """The n-gram match window the workspace gives an engine by default (conf/engine/<engine>.yaml `ngram`);
    (None, None) for an engine without one (SGLang) or unknown here."""
    from omegaconf import OmegaConf
    path = ROOT / "conf" / "engine" / f"{engine}.yaml"
    if not engine or not path.is_file():
        return None, None
    ngram = OmegaConf.load(path).get("ngram") or {}
    return ngram.get("min_match"), ngram.get("max_match")


@cache
def _uses_window(engine: str | None) -> bool:
    """Whether the engine's n-gram drafter takes a match window (vLLM's prompt lookup does, SGLang's trie does not);
    an engine the workspace does not know is taken to."""
    from experiments.engines import adapter_for
    try:
        return "ngram.min_match" in adapter_for(str(engine)).USED_KNOBS.get("ngram", frozenset())
    except (ValueError, KeyError):
        return True


def _details(spec: dict[str, Any], engine: str | None) -> list[str]:
    method = spec.get("method") or "none"
    out = []
    if method == "ngram":
        if spec.get("num_draft_tokens"):
            out.append(_count(int(spec["num_draft_tokens"]), "draft token", "draft tokens"))
        ngram = spec.get("ngram") or {}
        window = (ngram.get("min_match"), ngram.get("max_match"))
        if None not in window and _uses_window(engine) and tuple(map(str, window)) != tuple(
                map(str, engine_window(engine))):
            out.append(f"match window {window[0]}-{window[1]}")
    elif method == "eagle3":
        if spec.get("num_steps"):
            out.append(_count(int(spec["num_steps"]), "step", "steps"))
        if (spec.get("topk") or 1) != 1:
            out.append(f"top-{spec['topk']} tree")
    if spec.get("moe_expert_budget"):
        out.append(f"expert budget {spec['moe_expert_budget']}")
    return out


def option_words(option: str | None, spec: Any, engine: str | None = None) -> str:
    """A configuration in words: "A: n-gram, 4 draft tokens", "B: EAGLE-3, 3 steps", "no speculation". The match
    window is named only where it is not the one the engine gets by default (so two windows stay apart)."""
    s = _spec(spec)
    method = s.get("method") or "none"
    if method == "none":
        return METHODS["none"]
    what = ", ".join([METHODS.get(method, method), *_details(s, engine)])
    return f"{option}: {what}" if option else what


def config_words(config: Any) -> str:
    """A run's configuration (experiments.analysis.runs.RunConfig) in words."""
    return option_words(config.option, config.spec, config.engine)


def levels_words(levels: Iterable[int], prefix: str = "c = ") -> str:
    """Load levels in words: "c = 4", "c = 1 and 4", "c = 1, 4 and 8"."""
    shown = [str(c) for c in levels]
    if len(shown) <= 1:
        return prefix + "".join(shown)
    return f"{prefix}{', '.join(shown[:-1])} and {shown[-1]}"


def workload_words(workload: str | None, prompt_set: str | None = None) -> str:
    """A workload by its name, the prompt set it sends in parentheses where that has another name:
    "quick (prompt set grounded)", "grounded"."""
    name = workload or prompt_set or "?"
    return f"{name} (prompt set {prompt_set})" if prompt_set and prompt_set != name else name


def few_prompts(workload: str | None, prompts: int) -> str | None:
    """The warning for a level measured on fewer than MIN_PROMPTS prompts, with what to run instead; None when
    there are enough (or none: a level without records has no prompt count)."""
    if not 0 < prompts < MIN_PROMPTS:
        return None
    fix = "raise workload.num_prompts" if workload == "grounded" else "run workload=grounded"
    return f"{FEW_PROMPTS} ({prompts} per level, fewer than {MIN_PROMPTS}); {fix}"


@cache
def _option_spec(option: str) -> dict[str, Any]:
    from omegaconf import OmegaConf
    path = ROOT / "conf" / "option" / f"{option}.yaml"
    if not path.is_file():
        return {}
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False).get("spec") or {}


def set_by_default(option: str | None, engine: str | None, knob: str, value: Any) -> bool:
    """Whether `spec.<knob>` = `value` is what the option's yaml (conf/option/<option>.yaml) or the engine the run was
    measured on (its n-gram window) gives every run of that option: a default, not a setting anyone chose."""
    if knob in ("ngram.min_match", "ngram.max_match"):    # the option passes the engine's own window on
        default = engine_window(engine)[0 if knob.endswith("min_match") else 1]
        return default is not None and str(default) == str(value)
    raw: Any = _option_spec(option) if option else {}
    for part in knob.split("."):
        raw = raw.get(part) if isinstance(raw, Mapping) else None
    if isinstance(raw, str) and raw.startswith("${"):
        return True          # the option derives it (a drafter path, steps + 1): not a user's setting
    return raw is not None and str(raw) == str(value)
