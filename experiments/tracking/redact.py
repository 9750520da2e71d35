"""Secrets kept out of what a run records (params, tags, artifacts): credentials in URIs and the values of
environment variables named like secrets. Standard library only: the launch spec and preflight use it too."""
from __future__ import annotations

import re
from collections.abc import Mapping

MASK = "***"
# scheme://user[:password]@host -> scheme://***@host
_URI_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s:]+(?::[^/@\s]*)?@")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|AUTH|CREDENTIAL|(?:^|_)KEY(?:$|_)|APIKEY", re.IGNORECASE)
# a flattened config key inside an environment block: engine.env.HF_TOKEN, site.env.X
_ENV_PARAM = re.compile(r"(?:^|\.)env\.(?P<name>[^.]+)$")


def redact_text(text: str) -> str:
    """`text` with the credentials of every URI in it replaced by ***."""
    return _URI_CREDENTIALS.sub(lambda m: f"{m['scheme']}{MASK}@", text)


def secret_name(name: str) -> bool:
    """An environment variable name that looks like it holds a secret (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...)."""
    return bool(_SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment block as it may be recorded: secret-named values masked, URI credentials removed."""
    return {k: MASK if secret_name(k) else redact_text(str(v)) for k, v in env.items()}


def redact_params(params: Mapping[str, str]) -> dict[str, str]:
    """Flattened config params (or tags) as they may be recorded: URI credentials removed everywhere, the
    values of secret-named variables in `env` blocks masked."""
    out = {}
    for key, value in params.items():
        env = _ENV_PARAM.search(key)
        out[key] = MASK if env and secret_name(env["name"]) else redact_text(str(value))
    return out
