"""Option and baseline paired in time: two real token servers up together, blocks of first-seen prompts sent to
one and then the other in ABBA order; a host that changes state mid-run moves both arms of a block alike."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.analysis.stats import blocked_speedup, paired_speedup, prompt_blocks, prompt_totals
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.harness.client import (
    RequestSettings,
    WorkloadRunner,
    fixed_prompts,
    interleaved_order,
    run_interleaved,
)
from experiments.harness.workloads.sampling import plan_visits
from tests.helpers.loopback_server import sent_times, slow_down, start_loopback

# 10 ms steps: a request's fixed costs (connection, scheduling on a loaded 2-core host: tens of ms in CI) are a
# small part of its 160 or 320 ms; at 4 ms steps they pulled a true speedup of 2 down to 1.58 there
TOKENS, ITL_MS = 32, 10.0
PROMPTS = {f"p{i}": [100 + i, 1, 2] for i in range(16)}


@pytest.fixture
def servers():
    """The option's server streams two tokens per step, the baseline's one: a true speedup of 2."""
    option, baseline = start_loopback(2.0, ITL_MS, tokens_per_event=2), start_loopback(2.0, ITL_MS)
    yield option, baseline
    option.stop()
    baseline.stop()


def _runner(server, path: Path, render) -> WorkloadRunner:
    return WorkloadRunner(server, SGLangAdapter(), "loopback", RequestSettings(TOKENS, 0.0, 0, 60), render, path)


def _plan(blocks: int):
    convs, render = fixed_prompts(PROMPTS)
    return plan_visits(convs, [1], blocks, 0, 0), render


def _records(results) -> list[dict]:
    return [vars(r) for level in results for r in level.records]


def _speedup(option_results, baseline_results, blocked: bool) -> float:
    o, b = _records(option_results), _records(baseline_results)
    if blocked:
        return blocked_speedup(prompt_totals(o), prompt_totals(b), prompt_blocks(o)).estimate
    return paired_speedup(prompt_totals(o), prompt_totals(b)).estimate


def test_blocks_alternate_abba_and_each_server_sees_each_prompt_once(servers, tmp_path):
    plan, render = _plan(blocks=4)
    option, baseline = servers
    calls: list[tuple[int, int, int]] = []
    results = run_interleaved((_runner(option, tmp_path / "o.jsonl", render),
                               _runner(baseline, tmp_path / "b.jsonl", render)), plan,
                              lambda level, rep, pos: calls.append((level, rep, pos)))
    starts = sorted((lv.started_unix, which, lv.records[0].repetition)
                    for which, res in enumerate(results) for lv in res)
    order = [which for _, which, _ in starts]
    assert order == [0, 1, 1, 0, 0, 1, 1, 0]                          # ABBA over the run
    assert [interleaved_order(0, rep, 4)[0] for rep in range(4)] == [0, 1, 0, 1]
    assert [rep for _, _, rep in starts] == [0, 0, 1, 1, 2, 2, 3, 3]  # both arms of a block back to back
    assert calls == [(1, rep, pos) for rep in range(4) for pos in range(3)]
    for server in servers:
        prompts = [v["prompt"] for v in sent_times(server).values()]
        assert len(prompts) == len(PROMPTS) == len(set(prompts))      # every prompt once, on each server


def test_a_host_that_slows_mid_run_moves_both_arms_when_paired_in_time(servers, tmp_path):
    """The host's speed halves after the first half of the run (both servers slow down at once). Measured one
    server after the other, the option meets only the slow host and its speedup of 2 reads as about 1; paired in
    time, every block's two arms see the same host and the speedup stays 2."""
    option, baseline = servers
    plan, render = _plan(blocks=4)

    def flip(level: int, rep: int, position: int) -> None:
        if (rep, position) == (1, 2):          # after the second block pair
            for server in servers:
                slow_down(server, 2.5)

    paired = run_interleaved((_runner(option, tmp_path / "po.jsonl", render),
                              _runner(baseline, tmp_path / "pb.jsonl", render)), plan, flip)
    for server in servers:
        slow_down(server, 1.0)
    seq_base = _runner(baseline, tmp_path / "sb.jsonl", render).run(plan)
    for server in servers:
        slow_down(server, 2.5)
    seq_option = _runner(option, tmp_path / "so.jsonl", render).run(plan)

    assert 1.6 < _speedup(*paired, blocked=True) < 2.3
    assert _speedup(seq_option, seq_base, blocked=False) < 1.2
