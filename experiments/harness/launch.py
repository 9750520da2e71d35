"""Resolved config -> LaunchSpec: the exact server command line, its environment and port.

The command line is validated by the engine's own parser before anything starts (see engines/).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from omegaconf import DictConfig

from experiments.engines.config import (
    adapter_of,
    engine_name,
    server_env,
    sglang_patches_for,
    site_args,
)
from experiments.tracking.redact import redact_env, redact_text


@dataclass
class LaunchSpec:
    engine: str
    python: str
    module: str
    args: list[str]           # engine arguments without host/port
    env: dict[str, str]
    health_path: str
    port: int = 0
    host: str = "127.0.0.1"
    model_path: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [self.python, "-m", self.module, *self.args, "--host", self.host, "--port", str(self.port)]

    @property
    def key(self) -> str:
        """Identity of the server: jobs with the same key can share one running server."""
        blob = json.dumps([self.python, self.module, self.args, sorted(self.env.items())])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        """As recorded (launch_spec.json): secret-named env values and URI credentials redacted."""
        return {"engine": self.engine, "argv": [redact_text(a) for a in self.argv], "env": redact_env(self.env),
                "key": self.key, **self.extra}


def build_launch_spec(cfg: DictConfig) -> LaunchSpec:
    adapter = adapter_of(cfg)
    args = [str(a) for a in [*adapter.model_args(cfg), *site_args(cfg), *adapter.spec_args(cfg), *cfg.engine.extra_args,
                             *adapter.limit_args(cfg)]]   # the same limits on every command line, baseline included
    # Engines whose flag names change between releases (SGLang) spell them as the serving interpreter's release does.
    args = adapter.args_for_installed_version(cfg.engine.python, args)
    env = server_env(cfg)
    env |= adapter.launch_env(cfg, env)
    patches = sglang_patches_for(cfg)
    return LaunchSpec(engine=engine_name(cfg), python=cfg.engine.python, module=cfg.engine.module,
                      args=[str(a) for a in args], env={k: str(v) for k, v in env.items()},
                      health_path=cfg.engine.health_path, model_path=str(cfg.model.path),
                      extra={"sglang_patches": patches})
