"""experiments/engines/auth.py: API keys kept per server origin (scheme, host, port), the header every request to
that server carries, the message for a server that answers 401/403 (no key sent, or another key), and the refusal
of a key written into the engine's command line."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from experiments.config.errors import Refused
from experiments.engines.auth import auth_headers, origin, refuse_key_flags, use_key, wants_key

URL = "http://127.0.0.1:18123"


@pytest.fixture
def keyed() -> Iterator[str]:
    use_key(URL, "sk-test")
    yield URL
    use_key(URL, None)


def test_origin_fills_in_the_default_port_of_the_scheme() -> None:
    assert origin("http://Example.org/v1/models") == "http://example.org:80"
    assert origin("https://example.org/x") == "https://example.org:443"
    assert origin("http://127.0.0.1:8000/health?x=1") == "http://127.0.0.1:8000"


def test_a_key_goes_to_every_path_of_its_origin_only(keyed: str) -> None:
    assert auth_headers(keyed + "/v1/completions") == {"Authorization": "Bearer sk-test"}
    assert auth_headers(keyed + "/metrics") == {"Authorization": "Bearer sk-test"}
    assert auth_headers("http://127.0.0.1:18124/metrics") == {}


def test_use_key_none_forgets_the_key(keyed: str) -> None:
    use_key(keyed, None)
    assert auth_headers(keyed) == {}
    use_key(keyed, "")            # an empty variable is no key either
    assert auth_headers(keyed) == {}


def test_wants_key_without_a_key_says_to_name_the_variable() -> None:
    why = wants_key("http://127.0.0.1:18125", 401, "/health")
    assert why.startswith("the server at http://127.0.0.1:18125 wants an API key (HTTP 401 on /health)")
    assert "server.api_key_env" in why


def test_wants_key_with_a_key_sent_says_the_key_is_another(keyed: str) -> None:
    why = wants_key(keyed, 403, "/v1/models")
    assert why.startswith(f"the server at {keyed} refused the API key sent (HTTP 403 on /v1/models)")


def test_a_key_on_the_command_line_is_refused_in_either_form() -> None:
    with pytest.raises(Refused, match=r"^--api-key is set in the config"):
        refuse_key_flags(["--port", "8000", "--api-key", "secret"])
    with pytest.raises(Refused, match=r"^--admin-api-key is set in the config"):
        refuse_key_flags(["--admin-api-key=secret"])
    refuse_key_flags(["--port", "8000", "--api-key-env-name", "X"])   # another flag: no refusal
