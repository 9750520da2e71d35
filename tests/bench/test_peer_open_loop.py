"""The peer check's open-loop mode on the loopback server (known service time): `vllm bench serve` itself, run as the
check runs it (`--request-rate R --burstiness B --seed S --max-concurrency c`), releases the requests at the very
times our schedule gives for that seed, and our side reports TTFT and e2e both from the send (vLLM's definition)
and from the scheduled arrival."""
from __future__ import annotations

import pytest
from conftest import VLLM_PYTHON

from experiments.bench.peer_agreement import Prompt, ours_pass, same_schedule
from experiments.bench.vllm_peer import run_peer, write_dataset
from experiments.harness.arrivals import Arrivals, gamma_arrivals
from tests.helpers.loopback_server import start_loopback

TTFT_MS, ITL_MS, TOKENS, N = 150.0, 20.0, 6, 8
ARRIVALS = Arrivals("gamma", 5.0, 0.5, 11)
# a release or a send late on a loaded 2-core host, per request
LATE_MS = 60.0


@pytest.fixture(scope="module")
def loopback():
    server = start_loopback(ttft_ms=TTFT_MS, itl_ms=ITL_MS)
    yield server
    server.stop()


def test_vllm_bench_serve_releases_the_requests_at_our_schedule(loopback, tmp_path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}; run bin/setup")
    write_dataset([f"prompt number {i}" for i in range(N)], TOKENS, tmp_path / "prompts.jsonl")
    peer = run_peer(loopback.base_url, tmp_path / "prompts.jsonl", N, N, TOKENS, tmp_path, ARRIVALS)
    schedule = gamma_arrivals(N, ARRIVALS.rate, ARRIVALS.burstiness, ARRIVALS.seed)
    ours = {"per_request": {"arrival_s": schedule}}
    (diff,) = same_schedule([ours], [peer])["max_abs_diff_ms"]
    assert diff < LATE_MS, (diff, peer["per_request"]["released_s"], schedule)
    # another seed is another schedule: the check can tell
    other = {"per_request": {"arrival_s": gamma_arrivals(N, ARRIVALS.rate, ARRIVALS.burstiness, 12)}}
    assert same_schedule([other], [peer])["max_abs_diff_ms"][0] > 10 * LATE_MS
    assert peer["metrics"]["ttft_queued_mean_ms"] >= peer["metrics"]["ttft_mean_ms"]


def test_ours_reports_ttft_and_e2e_from_the_send_and_from_the_arrival(loopback, tmp_path) -> None:
    prompts = [Prompt(f"p{i}", [100 + i, 1, 2]) for i in range(N)]
    m = ours_pass(loopback, prompts, 1, TOKENS, tmp_path, ARRIVALS)["metrics"]   # cap 1: requests queue
    service_ms = TTFT_MS + (TOKENS - 1) * ITL_MS
    assert m["ttft_mean_ms"] == pytest.approx(TTFT_MS, abs=LATE_MS)
    assert m["e2e_mean_ms"] == pytest.approx(service_ms, abs=LATE_MS)
    assert m["queue_mean_ms"] > 100.0                               # 5 requests/s on a 250 ms server, one slot
    assert m["ttft_queued_mean_ms"] == pytest.approx(m["ttft_mean_ms"] + m["queue_mean_ms"], rel=1e-9)
    assert m["e2e_queued_mean_ms"] == pytest.approx(m["e2e_mean_ms"] + m["queue_mean_ms"], rel=1e-9)


def test_both_clients_measure_the_same_open_loop_latencies_on_a_known_server(loopback, tmp_path) -> None:
    """One schedule, one cap, a server whose timing is fixed: with the server's noise gone, the two clients' means
    of TTFT, ITL, TPOT and e2e, from the send and from the arrival, agree within 5 %. (TPOT from chunks: the
    loopback streams one token per event, and vLLM counts tokens by retokenising the loopback's made-up text.)"""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}; run bin/setup")
    cap, arrivals = 1, Arrivals("poisson", 6.0, 1.0, 5)   # 4 requests/s served: a queue builds
    prompts = [Prompt(f"p{i}", [100 + i, 1, 2]) for i in range(N)]
    ours = ours_pass(loopback, prompts, cap, TOKENS, tmp_path, arrivals)["metrics"]
    write_dataset([f"prompt number {i}" for i in range(N)], TOKENS, tmp_path / "prompts.jsonl")
    peer = run_peer(loopback.base_url, tmp_path / "prompts.jsonl", N, cap, TOKENS, tmp_path, arrivals)["metrics"]
    for m in (ours, peer):
        m["tpot_chunks_ms"] = (m["e2e_mean_ms"] - m["ttft_mean_ms"]) / (TOKENS - 1)
    assert ours["queue_mean_ms"] > 50.0 and peer["queue_mean_ms"] > 50.0    # the cap held requests back
    for key in ("ttft_mean_ms", "itl_mean_ms", "e2e_mean_ms", "tpot_chunks_ms", "ttft_queued_mean_ms",
                "e2e_queued_mean_ms"):
        assert ours[key] == pytest.approx(peer[key], rel=0.05), (key, ours[key], peer[key])
