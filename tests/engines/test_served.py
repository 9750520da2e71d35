"""experiments/engines/served.py: flattening a server's config, which settings two servers are compared on, the
speculation a config expects against what a server reports, the facts read from a /metrics page (written by
prometheus_client as vLLM writes it), and what is read back from a URL where nothing answers."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest

from experiments.engines.served import (
    _metric_facts,
    behaviour_settings,
    expected_speculation,
    flat,
    read_sglang,
    read_vllm,
    settings_mismatch,
    speculation_mismatch,
)
from tests.helpers.ports import closed_port_url


def test_flat_dots_nested_keys_and_writes_lists_as_json() -> None:
    config = {"scheduler_config": {"max_num_seqs": 8, "chunked": True}, "sizes": [1, 2, 4], "name": None}
    assert flat(config, "config") == {"config.scheduler_config.max_num_seqs": "8",
                                      "config.scheduler_config.chunked": "True",
                                      "config.sizes": "[1, 2, 4]", "config.name": "None"}


def test_settings_mismatch_names_only_compared_keys_that_differ() -> None:
    a = {"config.model_config.dtype": "bfloat16", "config.scheduler_config.max_num_seqs": "8",
         "config.port": "8000", "config.speculative_config.method": "ngram", "async_scheduling": "False",
         "only_in_a": "1"}
    b = {"config.model_config.dtype": "float32", "config.scheduler_config.max_num_seqs": "8",
         "config.port": "8001", "config.speculative_config.method": "none", "async_scheduling": "True"}
    assert settings_mismatch(a, b) == ["config.model_config.dtype: bfloat16 vs float32"]


def test_behaviour_settings_drops_volatile_inherent_and_speculative_keys() -> None:
    settings = {"max_model_len": "2048", "env.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": "shm-1", "version": "0.32",
                "config.speculative_config.num_speculative_tokens": "4", "config.max_num_scheduled_tokens": "9",
                "cache_config.block_size": "16", "kv_events.publisher": "null"}   # a volatile section
    assert behaviour_settings(settings) == {"max_model_len": "2048", "cache_config.block_size": "16"}


def test_expected_speculation_per_engine_and_method() -> None:
    assert expected_speculation("vllm", "none", 3, 4) == {"method": "none"}
    assert expected_speculation("vllm", "eagle3", 3, 4) == {"method": "eagle3", "k": "3"}
    assert expected_speculation("vllm", "ngram", None, 5) == {"method": "ngram", "k": "5"}
    assert expected_speculation("sglang", "eagle3", 3, 4) == {"method": "eagle3", "k": "4"}
    assert expected_speculation("vllm", "eagle3", None, 4) == {"method": "eagle3"}


def test_speculation_mismatch_says_what_differs() -> None:
    assert speculation_mismatch({"method": "ngram", "k": "4"}, {"method": "ngram", "k": "4"}) is None
    assert speculation_mismatch({"method": "ngram", "k": "4"}, {"method": "none"}) == \
        "it runs speculation 'none', the config asks for 'ngram'"
    assert speculation_mismatch({"method": "ngram", "k": "4"}, {"method": "ngram", "k": "2"}) == \
        "it drafts 2 tokens per step, the config asks for 4"


def test_a_server_that_only_says_it_speculates_matches_any_method_but_not_none() -> None:
    assert speculation_mismatch({"method": "eagle3", "k": "3"}, {"method": "speculating"}) is None
    assert speculation_mismatch({"method": "none"}, {"method": "speculating"}) == \
        "it runs speculation 'speculating', the config asks for 'none'"


def test_metric_facts_read_cache_labels_start_time_and_spec_counters() -> None:
    registry = CollectorRegistry()   # the families vLLM registers (v1/metrics/loggers.py), by prometheus_client
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labelnames=["block_size", "engine"],
          registry=registry).labels(block_size="16", engine="").set(1)
    ProcessCollector(registry=registry)
    text = generate_latest(registry).decode()
    labels, start, spec = _metric_facts(text)
    assert labels == {"cache_config.block_size": "16", "cache_config.engine": ""}
    assert start is not None and start > 1.6e9
    assert spec is False
    Counter("vllm:spec_decode_num_drafts", "drafts", registry=registry).inc(3)
    assert _metric_facts(generate_latest(registry).decode())[2] is True


def test_metric_facts_of_no_page_are_empty() -> None:
    assert _metric_facts(None) == ({}, None, False)


def test_read_vllm_where_nothing_answers_reports_nothing_running() -> None:
    url = closed_port_url()
    served = read_vllm(url)
    assert (served.engine, served.version, served.settings) == ("vllm", "unknown", {})
    assert served.speculation == {"method": "none"} and served.limits == {}
    assert served.instance == url and served.start_time is None


def test_read_sglang_where_nothing_answers_has_no_sources() -> None:
    served = read_sglang(closed_port_url())
    assert (served.engine, served.version, served.sources) == ("sglang", "unknown", [])
    assert served.speculation == {"method": "none"} and served.limits == {}


def test_flat_of_an_empty_mapping_is_nothing_but_a_nested_empty_one_stays() -> None:
    assert flat({}) == {}
    assert flat({}, "env") == {}
    assert flat({"hf_overrides": {}, "n": 1}, "config") == {"config.hf_overrides": "{}", "config.n": "1"}


def test_read_sglang_where_nothing_answers_has_no_settings() -> None:
    assert read_sglang(closed_port_url()).settings == {}


def test_read_vllm_where_nothing_answers_lists_no_sources() -> None:
    assert read_vllm(closed_port_url()).sources == []


class _DevModeServer(BaseHTTPRequestHandler):
    """A vLLM dev-mode server whose /server_info answers (with no VLLM_* environment) and nothing else does."""
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if not self.path.startswith("/server_info"):
            self.send_error(404)
            return
        body = json.dumps({"vllm_config": {"scheduler_config": {"max_num_seqs": 8}}, "vllm_env": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_read_vllm_lists_only_answering_sources_and_no_empty_environment() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DevModeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        served = read_vllm(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert served.sources == ["/server_info"]
    assert served.settings == {"config.scheduler_config.max_num_seqs": "8"}
    assert served.version == "unknown"
