"""No silent drops: a spec setting the chosen engine, method and release will not use is refused before launch
(dry runs included), naming it. Called by preflight.check_option."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from experiments.config.paths import ROOT
from experiments.config.views import ConfigError, spec_view
from experiments.engines import adapter_for

OPTIONS = ROOT / "conf" / "option"


def refuse_unused_knobs(cfg: DictConfig) -> None:
    """Raise preflight.Refused naming every spec setting a user gave that the engine would ignore. Settings
    the option overlay itself makes (e.g. option E's EAGLE steps when the model drafts with NGRAM) are the
    option's, not the user's: they are left to the option (and still listed by EngineAdapter.unused_knobs)."""
    from experiments.config.errors import Refused
    from experiments.engines.config import sglang_patches_for

    try:
        spec = spec_view(cfg.spec)
    except ConfigError as exc:
        raise Refused(str(exc)) from None
    reasons = adapter_for(cfg.engine.name).unused_knob_reasons(spec, sglang_patches_for(cfg))
    users = [why for knob, why in reasons.items() if not _set_by_option(cfg, knob)]
    if users:
        raise Refused(f"{cfg.engine.name} would not use these settings: " + "; ".join(users))


def _set_by_option(cfg: DictConfig, knob: str) -> bool:
    """Whether `knob` (dotted, from the root) has exactly the value the option's own yaml gives it."""
    option = cfg.get("option")
    path = OPTIONS / f"{option.name}.yaml" if option is not None else None
    if path is None or not path.exists():
        return False
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    for part in knob.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    if raw is None:
        return False
    probe = OmegaConf.merge(cfg, _nested(knob, raw))  # the option's value, resolved where the option puts it
    return OmegaConf.select(probe, knob) == OmegaConf.select(cfg, knob)


def _nested(knob: str, value: object) -> dict:
    out: object = value
    for part in reversed(knob.split(".")):
        out = {part: out}
    return out
