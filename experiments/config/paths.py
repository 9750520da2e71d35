"""Where the workspace keeps things, and the OmegaConf resolvers that let configs name those places."""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from experiments.config import flags

ROOT = Path(__file__).resolve().parents[2]
PROMPT_SETS = ROOT / "experiments" / "prompt_sets"


def cache_dir() -> Path:
    """Downloaded and generated assets (venvs, converted models): git-ignored, overridable for CI."""
    return Path(os.environ.get("SPECWS_CACHE", ROOT / ".cache")).resolve()


def _largest(xs) -> int:
    """The largest of a list of levels, or a single level given as a scalar."""
    return max(int(x) for x in (xs if isinstance(xs, list | tuple) or OmegaConf.is_list(xs) else [xs]))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("ws.cache"):
        OmegaConf.register_new_resolver("ws.cache", lambda rel="": str(cache_dir() / rel))
    if not OmegaConf.has_resolver("ws.root"):
        OmegaConf.register_new_resolver("ws.root", lambda rel="": str(ROOT / rel))
    if not OmegaConf.has_resolver("ws.add"):  # e.g. EAGLE draft tokens = steps + 1 (conf/option/C.yaml)
        OmegaConf.register_new_resolver("ws.add", lambda *xs: sum(int(x) for x in xs))
    if not OmegaConf.has_resolver("ws.max"):  # e.g. the largest concurrency level (conf/config.yaml limits)
        OmegaConf.register_new_resolver("ws.max", _largest)
    if not OmegaConf.has_resolver("ws.pid"):  # Hydra's output folders: two runners in one second stay apart
        OmegaConf.register_new_resolver("ws.pid", lambda: str(os.getpid()))
    flags.register()   # ws.flags, ws.flag_reasons, ws.flag_value: a site's flags composed from another's


register_resolvers()
