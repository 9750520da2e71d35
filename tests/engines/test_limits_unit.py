"""experiments/engines/limits.py, its helpers one by one (tests/engines/test_limits.py covers the limits on real
command lines): a limit as logged (`scalar`), numbers and text compared alike in `limits_mismatch`, and `get_json`
fetching JSON with the server's API key -- from a local HTTP server of the test (a plain JSON endpoint, not an
engine), a closed port, and a page that is not JSON."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from experiments.engines.auth import use_key
from experiments.engines.limits import authorized, get_json, limits_mismatch, scalar


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/json":
            body = json.dumps({"authorization": self.headers.get("Authorization")}).encode()
        elif self.path == "/text":
            body = b"# HELP not json\n"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def json_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_scalar_keeps_numbers_as_float_and_names_as_text() -> None:
    assert scalar(48) == 48.0 and isinstance(scalar(48), float)
    assert scalar(0.5) == 0.5
    assert scalar(True) == "True"        # a bool is not logged as 1.0
    assert scalar("NGRAM") == "NGRAM"
    assert scalar(None) is None and scalar([1, 2]) is None and scalar({"a": 1}) is None


def test_limits_mismatch_compares_numbers_as_numbers_and_the_rest_as_text() -> None:
    assert limits_mismatch({"max_num_seqs": "48", "enable_chunked_prefill": True},
                           {"max_num_seqs": 48.0, "enable_chunked_prefill": "True"}) == []
    assert limits_mismatch({"max_num_seqs": "48", "enable_chunked_prefill": True, "max_model_len": 2048},
                           {"max_num_seqs": 64, "enable_chunked_prefill": "False", "max_model_len": 2048}) == \
        ["enable_chunked_prefill: True vs False", "max_num_seqs: 48 vs 64"]


def test_get_json_reads_the_page_and_sends_the_servers_key(json_server: str) -> None:
    assert get_json(json_server + "/json") == {"authorization": None}
    use_key(json_server, "sk-limits")
    try:
        assert get_json(json_server + "/json") == {"authorization": "Bearer sk-limits"}
        assert authorized(json_server + "/x").get_header("Authorization") == "Bearer sk-limits"
    finally:
        use_key(json_server, None)


def test_get_json_is_none_for_an_error_page_text_or_no_server(json_server: str) -> None:
    assert get_json(json_server + "/missing") is None
    assert get_json(json_server + "/text") is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert get_json(f"http://127.0.0.1:{closed}/json") is None
