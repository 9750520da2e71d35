"""An option overlay applied to an already composed config: the paired baseline of a measurement and option D's
evaluation are this config with another option's yaml (conf/option/<name>.yaml) laid over it, not blocks
rebuilt in code. The overlay's `defaults` (group overrides such as C's engine) are deliberately not applied:
a baseline runs on the engine of the option it is paired with."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from experiments.config.paths import ROOT

OPTIONS = ROOT / "conf" / "option"


def option_file(name: str) -> DictConfig:
    path = OPTIONS / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in OPTIONS.glob("*.yaml"))
        raise FileNotFoundError(f"no option overlay {path} (options: {', '.join(known)})")
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    return node


def with_option(cfg: DictConfig, name: str, sections: tuple[str, ...] = ("option", "spec", "baseline"),
                **option_fields: object) -> DictConfig:
    """`cfg` with option `name`'s overlay: its `option` block replaces the current one (plus `option_fields`),
    its other `sections` are merged over the current ones (keys it does not set stay as they are)."""
    overlay = option_file(name)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.option = OmegaConf.merge(overlay.option, dict(option_fields))
    for section in sections:
        if section != "option" and section in overlay:
            out[section] = OmegaConf.merge(out.get(section) or {}, overlay[section])
    return out


def set_by_option(cfg: DictConfig, knob: str) -> bool:
    """Whether `knob` (dotted from the root: `spec.num_steps`, `spec.ngram.max_match`) has exactly the value the
    chosen option's own yaml gives it: the option's setting, not the user's."""
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
    nested: object = raw
    for part in reversed(knob.split(".")):
        nested = {part: nested}
    probe = OmegaConf.merge(cfg, nested)   # the option's value, resolved where the option puts it
    return OmegaConf.select(probe, knob) == OmegaConf.select(cfg, knob)
