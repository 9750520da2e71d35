"""Secrets kept out of what a run records (params, tags, artifacts, the Hydra folder, server logs): credentials in
URIs, the values of environment variables named like secrets, and every literal secret value registered for
this process (from the config, the Hydra overrides and the runner's environment). Standard library only: the
launch spec and preflight use it too."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote

MASK = "***"
MIN_SECRET_LEN = 4
# scheme://user[:password]@host -> scheme://***@host
_URI_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s:]+(?::[^/@\s]*)?@")
_URI_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]+:(?P<password>[^/@\s]+)@")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|AUTH|CREDENTIAL|(?:^|_)KEY(?:$|_)|APIKEY", re.IGNORECASE)
# a flattened config key inside an environment block: engine.env.HF_TOKEN, site.env.X
_ENV_PARAM = re.compile(r"(?:^|\.)env\.(?P<name>[^.]+)$")
# the strict rule, on a name's last segment: hf_token, api_key, DB_PASSWORD, --api-key; not max_tokens, bos_token_id
_SECRET_SEGMENTS = {"token", "secret", "password", "passwd", "apikey", "credential", "credentials", "auth"}
_SEGMENT = re.compile(r"[._\-]+")
# values no secret has, which would otherwise mask every `true` or `8` of a file
_NOT_SECRETS = {"true", "false", "none", "null", "auto", "yes", "no"}
_BINARY_PROBE = 8192
# a block-style YAML value that now starts with the mask: `*` would start an alias there, so it is quoted
_YAML_MASKED_VALUE = re.compile(r"^(?P<lead>[ \t]*(?:-[ \t]+)*(?:[^\s#'\"-][^\n]*?:[ \t]+)?)"
                                r"(?P<value>\*\*\*[^\n]*?)[ \t]*$", re.MULTILINE)
_YAML_SUFFIXES = (".yaml", ".yml")

_registered: set[str] = set()


def redact_text(text: str) -> str:
    """`text` with every registered secret and the credentials of every URI in it replaced by ***."""
    for secret in sorted(_registered, key=len, reverse=True):   # longest first: a secret holding another
        if secret in text:
            text = text.replace(secret, MASK)
    return _URI_CREDENTIALS.sub(lambda m: f"{m['scheme']}{MASK}@", text)


def redact_file_text(text: str, name: str) -> str:
    """The text of a file called `name`, redacted; a YAML file stays YAML (a value that is now `***` is quoted)."""
    redacted = redact_text(text)
    if redacted == text or not name.lower().endswith(_YAML_SUFFIXES):
        return redacted
    return _YAML_MASKED_VALUE.sub(lambda m: f"{m['lead']}'{m['value'].replace(chr(39), chr(39) * 2)}'", redacted)


def register_secrets(values: Iterable[str]) -> None:
    """Add literal secret values masked from now on by redact_text, for the rest of this process."""
    _registered.update(v for v in map(str, values) if plausible_secret(v))


def register_secret(value: str) -> None:
    """A value known to be a secret (an API key from the environment): masked from now on whatever it looks like,
    a number included, if it has MIN_SECRET_LEN characters."""
    if len(value.strip()) >= MIN_SECRET_LEN:
        _registered.add(value)


def registered_secrets() -> frozenset[str]:
    return frozenset(_registered)


def plausible_secret(value: str) -> bool:
    """Long enough, and not a number, a boolean or the mask itself."""
    stripped = value.strip()
    if len(stripped) < MIN_SECRET_LEN or stripped.lower() in _NOT_SECRETS or not stripped.strip("*"):
        return False
    try:
        float(stripped)
    except ValueError:
        return True
    return False


def secret_name(name: str) -> bool:
    """An environment variable name that looks like it holds a secret (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...)."""
    return bool(_SECRET_NAME.search(name))


def secret_key(name: str) -> bool:
    """A config key, flag or variable name whose value is a secret, by its last segment: hf_token, api_key,
    MLFLOW_TRACKING_PASSWORD, --api-key; not max_tokens, num_draft_tokens, bos_token_id, SSH_AUTH_SOCK."""
    segments = [s.lower() for s in _SEGMENT.split(name.strip("-+~")) if s]
    if not segments:
        return False
    return segments[-1] in _SECRET_SEGMENTS or (len(segments) > 1 and segments[-1] == "key")


def uri_passwords(text: str) -> set[str]:
    """The password of every `scheme://user:password@` in `text`, as written and URL-decoded."""
    found = {m["password"] for m in _URI_PASSWORD.finditer(text)}
    return found | {unquote(p) for p in found}


def flag_secrets(args: list) -> set[str]:
    """In a command line: the value after a secret-named flag (`--api-key X`, `--hf-token=X`)."""
    out = set()
    for i, arg in enumerate(args):
        if not isinstance(arg, str) or not arg.startswith("-"):
            continue
        flag, eq, value = arg.partition("=")
        if not secret_key(flag):
            continue
        if eq:
            out.add(value)
        elif i + 1 < len(args) and isinstance(args[i + 1], str):
            out.add(args[i + 1])
    return out


def secrets_of_config(cfg_container: dict) -> set[str]:
    """The secrets a resolved config holds: secret-named variables of any `env` block, URI passwords, leaves
    under a secret-named key, values of secret-named flags in any list (or string) of command-line args."""
    found: set[str] = set()
    _walk(cfg_container, "", found)
    return {v for v in found if plausible_secret(v)}


def _walk(node, key: str, found: set[str]) -> None:
    if isinstance(node, Mapping):
        for k, v in node.items():
            if str(k) == "env" and isinstance(v, Mapping):
                found.update(str(x) for name, x in v.items() if secret_name(str(name)) and isinstance(x, str))
            _walk(v, str(k), found)
    elif isinstance(node, list | tuple):
        found.update(flag_secrets(list(node)))
        for item in node:
            _walk(item, key, found)
    elif isinstance(node, str):
        if secret_key(key):
            found.add(node)
        found.update(uri_passwords(node))
        found.update(flag_secrets(node.split()))


def secrets_of_environ(environ: Mapping[str, str]) -> set[str]:
    """The values of the secret-named variables of an environment (HF_TOKEN, MLFLOW_TRACKING_PASSWORD, ...) and
    the URI passwords in any of its values."""
    found = {v for k, v in environ.items() if secret_key(k)}
    for value in environ.values():
        found |= uri_passwords(value)
    return {v for v in found if plausible_secret(v)}


def secrets_of_overrides(overrides: Iterable[str]) -> set[str]:
    """From Hydra command-line overrides (`key=value`): the value of a secret-named key, URI passwords and the
    values of secret-named flags anywhere."""
    found: set[str] = set()
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and secret_key(key.rsplit(".", 1)[-1]):
            found.add(value.strip("'\""))
        found |= uri_passwords(override) | flag_secrets(re.split(r"[\s,\[\]]+", value))
    return {v for v in found if plausible_secret(v)}


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment block as it may be recorded: secret-named values masked, URI credentials removed."""
    return {k: MASK if secret_name(k) else redact_text(str(v)) for k, v in env.items()}


def redact_param(key: str, value) -> str:
    """One flattened config param (or tag) as it may be recorded: the value of a secret-named variable of an
    `env` block masked, anything else redacted."""
    env = _ENV_PARAM.search(key)
    return MASK if env and secret_name(env["name"]) else redact_text(str(value))


def redact_params(params: Mapping[str, str]) -> dict[str, str]:
    """Flattened config params (or tags) as they may be recorded (redact_param)."""
    return {key: redact_param(key, value) for key, value in params.items()}


def read_text_file(path: str | Path) -> str | None:
    """The file's text; None for a binary file (a NUL byte in its head, or not UTF-8)."""
    with open(path, "rb") as f:
        head = f.read(_BINARY_PROBE)
        if b"\0" in head:
            return None
        data = head + f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def redacted_text_of(path: str | Path) -> str | None:
    """The redacted text of a text file that holds something to redact, else None."""
    text = read_text_file(path)
    if text is None:
        return None
    redacted = redact_file_text(text, Path(path).name)
    return redacted if redacted != text else None


def redact_file(path: str | Path) -> bool:
    """Rewrite a text file in place, redacted (atomically: a reader sees the old or the new file); binary
    files are left alone. True when it was rewritten."""
    path = Path(path)
    redacted = redacted_text_of(path)
    if redacted is None:
        return False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".redact")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(redacted)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def redact_folder(folder: str | Path) -> int:
    """redact_file on every regular file under `folder` (links are not followed); how many were rewritten."""
    files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file() and not p.is_symlink()]
    return sum(redact_file(p) for p in files)
