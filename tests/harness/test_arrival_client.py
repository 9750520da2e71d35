"""The open-loop client against the loopback server, whose service time is known (first token TTFT_S after a
request arrives, then one token every ITL_S): each request is sent at its scheduled arrival unless the cap is taken,
then as soon as a slot frees, exactly as a single queue in front of `concurrency` servers would send it; its TTFT and
e2e count from the scheduled arrival; a multi-turn conversation arrives once and sends its later turns after its
answers; a hung server ends the level without waiting for the arrivals still to come."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.arrivals import Arrivals, gamma_arrivals
from experiments.harness.client import RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.workloads.formats import Conversation
from experiments.harness.workloads.sampling import VisitPlan
from tests.helpers.loopback_server import start_loopback

TTFT_S, ITL_S, TOKENS = 0.2, 0.04, 10
SERVICE_S = TTFT_S + (TOKENS - 1) * ITL_S
# the client's and the loopback's event loops waking late on a shared 2-core host, per request
LATE_S = 0.12


@pytest.fixture(scope="module")
def loopback():
    server = start_loopback(ttft_ms=TTFT_S * 1000, itl_ms=ITL_S * 1000)
    yield server
    server.stop()


def _run(server, tmp: Path, convs: list[Conversation], render, cap: int, arrivals: Arrivals,
         settings: RequestSettings | None = None):
    runner = WorkloadRunner(server, VLLMAdapter(), "loopback", settings or RequestSettings(TOKENS, 0.0, 0, 60),
                            render, tmp / "records.jsonl", arrivals)
    (level,) = runner.run(VisitPlan(warmup=[], level_warmup={}, measured={(cap, 0): convs}, levels=[cap]))
    return level


def _expected_starts(schedule: list[float], cap: int) -> list[float]:
    """A FIFO queue in front of `cap` slots, each request holding one for SERVICE_S."""
    free, starts = [0.0] * cap, []
    for at in schedule:
        slot = min(range(cap), key=free.__getitem__)
        starts.append(max(at, free[slot]))
        free[slot] = starts[-1] + SERVICE_S
    return starts


@pytest.mark.parametrize(("cap", "rate"), [(1, 4.0), (2, 6.0), (8, 4.0)])
def test_requests_are_sent_as_a_queue_in_front_of_the_cap_sends_them(loopback, tmp_path: Path, cap: int,
                                                                     rate: float) -> None:
    convs, render = fixed_prompts({f"p{i}": [100 + i, 1, 2] for i in range(8)})
    arrivals = Arrivals("poisson", rate, 1.0, 4)
    level = _run(loopback, tmp_path, convs, render, cap, arrivals)
    schedule = gamma_arrivals(8, rate, 1.0, 4)
    records = sorted(level.records, key=lambda r: r.scheduled_s)
    assert [r.scheduled_s for r in records] == schedule and level.arrival == arrivals.describe()
    for r, start in zip(records, _expected_starts(schedule, cap), strict=True):
        assert r.error is None and r.start_s >= r.scheduled_s
        # lateness adds up along a queue of back-to-back requests: a bound per request in front of this one
        ahead = 1 + sum(s.start_s < r.start_s for s in records)
        assert r.start_s - start == pytest.approx(0.0, abs=LATE_S * ahead), (r.prompt_id, r.start_s, start)
        assert r.ttft_s == pytest.approx(r.queue_s + TTFT_S, abs=LATE_S)
        assert r.e2e_s == pytest.approx(r.queue_s + SERVICE_S, abs=LATE_S)
    if cap == 1:
        assert max(r.queue_s for r in records) > 1.0   # the cap held requests back: the queueing was measured


def test_a_multi_turn_conversation_arrives_once_and_sends_its_next_turn_after_its_answer(loopback,
                                                                                         tmp_path: Path) -> None:
    convs = [Conversation(f"c{i}", "all", (), ("first", "second"), None, "given") for i in range(3)]
    sent: list[tuple[str, int, int]] = []

    def render(conv: Conversation, turn: int, answers: list[str]) -> list[int]:
        sent.append((conv.id, turn, len(answers)))
        return [200 + turn, len(answers)]

    level = _run(loopback, tmp_path, convs, render, 2, Arrivals("poisson", 5.0, 1.0, 1))
    by = {(r.prompt_id, r.turn): r for r in level.records}
    assert len(by) == 6 and all(r.error is None for r in level.records)
    assert sorted(r.scheduled_s for r in level.records if r.turn == 0) == gamma_arrivals(3, 5.0, 1.0, 1)
    for conv in convs:
        first, second = by[(conv.id, 0)], by[(conv.id, 1)]
        assert second.scheduled_s is None and second.queue_s is None       # no arrival of its own
        assert second.start_s >= first.start_s + first.e2e_s - first.queue_s - 0.01   # after the answer
        assert second.ttft_s == pytest.approx(TTFT_S, abs=LATE_S)          # counted from its own send
    assert all(n == turn for _, turn, n in sent)                           # each later turn saw its answers


def test_a_hung_server_ends_the_level_without_waiting_for_later_arrivals(tmp_path: Path) -> None:
    slow = start_loopback(ttft_ms=3000, itl_ms=10)   # its first token comes after the stall timeout
    try:
        convs, render = fixed_prompts({f"p{i}": [100 + i] for i in range(4)})
        settings = RequestSettings(TOKENS, 0.0, 0, 60, stall_timeout_s=0.5)
        level = _run(slow, tmp_path, convs, render, 4, Arrivals("poisson", 0.4, 1.0, 2), settings)
    finally:
        slow.stop()
    schedule = gamma_arrivals(4, 0.4, 1.0, 2)
    kinds = sorted(r.error_kind for r in level.records)
    assert kinds[-1] == "stall" and set(kinds[:-1]) <= {"stall", "skipped_after_stall"}
    assert "skipped_after_stall" in kinds and level.wall_s < schedule[-1] - 1.0, (level.wall_s, schedule)
