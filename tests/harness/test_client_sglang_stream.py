"""The client's incremental parse of SGLang's cumulative /generate events (SGLangAdapter.parse_raw): the same
records as parsing every event whole, against the loopback server, with the whole-event parse used only for
the finishing event."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_fixed

from experiments.engines.sglang_engine import SGLangAdapter
from experiments.tracking.records import load_records
from tests.helpers.loopback_server import start_loopback


class Counting(SGLangAdapter):
    def __init__(self, incremental: bool):
        self.incremental, self.whole = incremental, 0

    def parse_raw(self, data, tokens_so_far):
        return super().parse_raw(data, tokens_so_far) if self.incremental else None

    def parse_event(self, event, tokens_so_far):
        self.whole += 1
        return super().parse_event(event, tokens_so_far)


def events(ids: list[int], text: str, finished: bool, sep: tuple[str, str]) -> bytes:
    meta = {"completion_tokens": len(ids), "finish_reason": {"type": "length"} if finished else None}
    return json.dumps({"text": text, "output_ids": ids, "meta_info": meta}, separators=sep).encode()


@pytest.mark.parametrize("sep", [(",", ":"), (", ", ": ")])
def test_parse_raw_agrees_with_parse_event(sep) -> None:
    a = SGLangAdapter()
    tricky = 'he said "output_ids": [9, 9] and "finish_reason": null ] ,'
    for ids, seen in (([], 0), ([5], 0), ([5, 6, 7], 1), ([5, 6, 7], 3), (list(range(300)), 297), ([1, 2], 0)):
        raw = events(ids, tricky, False, sep)
        fast = a.parse_raw(raw, seen)
        assert fast is not None and fast.token_ids == a.parse_event(json.loads(raw), seen).token_ids == ids[seen:]
        assert fast.text == "" and fast.meta is None
    done = events([1, 2, 3], tricky, True, sep)
    assert a.parse_raw(done, 2) is None            # the finishing event is parsed whole (text, meta_info)
    assert a.parse_event(json.loads(done), 2).text == tricky
    assert a.parse_raw(b'{"text": "x"}', 0) is None     # not SGLang's shape: parsed whole


@pytest.mark.parametrize("per_event", [1, 3])
def test_incremental_records_equal_whole_event_records(tmp_path: Path, per_event: int) -> None:
    server = start_loopback(ttft_ms=5.0, itl_ms=1.0, tokens_per_event=per_event)
    out = {}
    try:
        for incremental in (True, False):
            adapter = Counting(incremental)
            path = tmp_path / f"{incremental}.jsonl"
            run_fixed(server, adapter, 40, path, {f"p{i}": [100 + i, 1, 2] for i in range(6)}, [3])
            out[incremental] = (adapter.whole, sorted(load_records(path), key=lambda r: r["prompt_id"]))
    finally:
        server.stop()
    (whole_fast, fast), (whole_slow, slow) = out[True], out[False]
    events_per_request = -(-40 // per_event)
    assert whole_slow == 6 * events_per_request
    assert whole_fast == 6                           # one whole parse per request: its finishing event
    for f, s in zip(fast, slow, strict=True):
        assert f["error"] is None and s["error"] is None
        assert f["output_token_ids"] == s["output_token_ids"] == list(range(40))
        assert f["chunk_tokens"] == s["chunk_tokens"] and sum(f["chunk_tokens"]) == 40
        assert len(f["chunk_times_s"]) == events_per_request and f["ttft_s"] == f["chunk_times_s"][0]
        untagged = [re.sub(r"^ r\d+\|", "", r["text"]) for r in (f, s)]   # the server's per-request serial
        assert untagged[0] == untagged[1] and untagged[0].startswith(" w0 w1")
        assert f["meta"] == s["meta"] and f["meta"]["finish_reason"] == {"type": "length"}


def test_warm_up_batch_at_each_concurrency_is_not_recorded(tmp_path: Path) -> None:
    """warmup=1: one request at c1, then one unrecorded batch of `level` requests before each level > 1."""
    server = start_loopback(ttft_ms=2.0, itl_ms=0.5, tokens_per_event=1)
    prompts = {f"p{i}": [100 + i, 1, 2] for i in range(5)}
    try:
        served = {}
        for warmup in (0, 1):
            adapter = Counting(True)               # one whole-event parse per request: its finishing event
            path = tmp_path / f"w{warmup}.jsonl"
            run_fixed(server, adapter, 8, path, prompts, [1, 3], warmup=warmup)
            served[warmup] = adapter.whole
            records = load_records(path)
            assert len(records) == 2 * (len(prompts) - warmup)     # warm-ups never reach the records
            assert warmup == 0 or not {r["prompt_id"] for r in records} & warm_ids(prompts, warmup)
    finally:
        server.stop()
    assert served == {0: 10, 1: 8 + 1 + 3}


def warm_ids(prompts: dict, warmup: int) -> set[str]:
    from experiments.harness.client import fixed_prompts
    from experiments.harness.workloads.sampling import plan_visits
    plan = plan_visits(fixed_prompts(prompts)[0], [1, 3], 1, warmup, 0, True)
    return {c.id for c in plan.warmup}
