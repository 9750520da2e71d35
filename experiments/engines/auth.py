"""API keys of the servers a run talks to, kept per server origin: every request to that server -- the workload,
its settings read back, the identity and greedy checks -- carries its key as `Authorization: Bearer <key>`. The key
comes from the environment variable that `server.api_key_env` names (experiments.harness.launch.api_key), never
from the config's own values.
vLLM (`--api-key`, `VLLM_API_KEY`) and SGLang (`--api-key`) answer a request without it with HTTP 401."""
from __future__ import annotations

from urllib.parse import urlsplit

from experiments.config.errors import Refused

WANTS_KEY = (401, 403)
# flags that would put a key into the config (and the recorded command line) instead of the environment
KEY_FLAGS = ("--api-key", "--admin-api-key")
_keys: dict[str, str] = {}


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def use_key(url: str, key: str | None) -> None:
    """Send `key` with every request to the server at `url` from now on (None: none)."""
    if key:
        _keys[origin(url)] = key
    else:
        _keys.pop(origin(url), None)


def auth_headers(url: str) -> dict[str, str]:
    """The headers a request to `url` carries: its server's key, if it has one."""
    key = _keys.get(origin(url))
    return {"Authorization": f"Bearer {key}"} if key else {}


def wants_key(url: str, status: int, path: str) -> str:
    """Why a server answered `status` (401/403): it wants a key, or another one than the one sent."""
    if origin(url) in _keys:
        return (f"the server at {url} refused the API key sent (HTTP {status} on {path}): the variable that "
                "server.api_key_env names holds another key than the server's")
    return (f"the server at {url} wants an API key (HTTP {status} on {path}): export it in an environment variable "
            "and name that variable in server.api_key_env")


def refuse_key_flags(args: list[str]) -> None:
    """An API key given on the engine's command line in the config is refused: it comes from the environment."""
    given = [a for a in args if str(a).split("=", 1)[0] in KEY_FLAGS]
    if given:
        flag = given[0].split("=", 1)[0]
        raise Refused(f"{flag} is set in the config (engine.extra_args or the site's flags): put the key in an "
                      "environment variable and name it in server.api_key_env; the workspace passes it to the "
                      "servers it starts and sends it to every server")
