"""The typed run -> LaunchSpec: the exact server command line, its environment and port.

The command line is validated by the engine's own parser before anything starts (see engines/).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from experiments.config.errors import Refused
from experiments.config.views import RunView
from experiments.engines import adapter_for
from experiments.engines.config import launch_view_of
from experiments.tracking.redact import redact_env, redact_text, register_secret


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
    api_key: str | None = field(default=None, repr=False)   # the server wants it (server.api_key_env); never recorded

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


def build_launch_spec(run: RunView) -> LaunchSpec:
    """The server's command line and environment, built by the engine's adapter from the typed launch view."""
    launch = launch_view_of(run)
    adapter = adapter_for(launch.engine.name)
    # the limits go on every command line, baseline included
    args = [str(a) for a in [*adapter.model_args(launch.model), *launch.site_args, *adapter.spec_args(launch.spec),
                             *launch.engine.extra_args, *adapter.limit_args(launch.limits, launch.given_args)]]
    # Engines whose flag names change between releases (SGLang) spell them as the serving interpreter's release does.
    args = adapter.args_for_installed_version(launch.engine.python, args)
    env = dict(launch.env)
    env |= adapter.launch_env(launch, env)
    key = api_key(run.server.api_key_env)
    if key:
        key_args, key_env = adapter.api_key_launch(key)
        args, env = [*args, *key_args], env | key_env
    return LaunchSpec(engine=launch.engine.name, python=launch.engine.python, module=launch.engine.module,
                      args=[str(a) for a in args], env={k: str(v) for k, v in env.items()},
                      health_path=launch.engine.health_path, model_path=launch.model.path,
                      extra={"sglang_patches": launch.patches}, api_key=key)


def api_key(env_name: str | None) -> str | None:
    """The servers' API key, from the environment variable `env_name` (`server.api_key_env`; None: no key),
    registered as a secret (masked in everything a run writes or prints); refused when that variable is unset."""
    if not env_name:
        return None
    key = os.environ.get(str(env_name), "")
    if not key.strip():
        raise Refused(f"server.api_key_env={env_name}: the environment variable {env_name} is not set; export it "
                      "with the server's API key (the key itself never goes into the config)")
    register_secret(key)
    return key
