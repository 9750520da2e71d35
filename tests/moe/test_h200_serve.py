"""experiments.moe.h200_serve's servers: the telemetry and budget phases verify with NGRAM on every model (Kimi's
option E drafts with EAGLE-3, whose verify carries what its head proposed), and a setting SGLang would not use
is refused before a server starts, as the runner refuses it. Its requests go through the harness's client: a pass
on the loopback server (SGLang's streamed /generate) records the fields it recorded before."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.config.errors import Refused
from experiments.config.paths import ROOT
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.harness.server import Server
from experiments.moe import h200_serve
from tests.helpers.loopback_server import sent_times, start_loopback


def args(model: Path, model_config: str, site: str) -> argparse.Namespace:
    return argparse.Namespace(model=model, model_config=model_config, site=site, overrides=[],
                              concurrency=[1, 4, 16, 64])


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi") / "model"
    subprocess.run([sys.executable, "-m", "experiments.box.kimi_mini", "build", "--out", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.mark.parametrize("model_config, site", [("kimi_k25_mini", "h200-kimi"), ("tiny_moe_dsv3", "h200")])
def test_budget_phases_verify_with_ngram_chains(kimi: Path, model_config: str, site: str) -> None:
    spec = h200_serve.launch_spec(args(kimi, model_config, site), "E",
                                  {"num_draft_tokens": 5, **h200_serve.NGRAM, "moe_expert_budget": 64}, [])
    argv = spec.argv
    assert argv[argv.index("--speculative-algorithm") + 1] == "NGRAM"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "5"
    assert argv[argv.index("--speculative-ngram-max-bfs-breadth") + 1] == "1"
    assert "--speculative-draft-model-path" not in argv and "--speculative-num-steps" not in argv
    assert spec.env["SPECWS_MOE_EXPERT_BUDGET"] == "64"


def test_a_setting_sglang_would_not_use_is_refused(kimi: Path) -> None:
    # chain-draft settings on Kimi's option E as it stands (EAGLE-3): SGLang would not pass them
    with pytest.raises(Refused, match="spec.ngram.max_bfs_breadth"):
        h200_serve.launch_spec(args(kimi, "kimi_k25_mini", "h200-kimi"), "E",
                               {"num_draft_tokens": 4, **h200_serve.NGRAM_CHAIN}, [])


def test_warmups_are_a_copy_never_measured() -> None:
    base = [{"id": f"p{i}", "token_ids": [i * 10 + j for j in range(6)]} for i in range(5)]
    measured, warmups = h200_serve.measured_and_warmups(base, 3, h200_serve.PROMPT_VOCAB)
    assert len(measured) == 15 and len(warmups) == 5
    assert measured[:5] == base                      # the first copy is the prompts themselves
    assert not {p["id"] for p in measured} & {p["id"] for p in warmups}
    firsts = {tuple(p["token_ids"][:2]) for p in measured}
    assert not firsts & {tuple(p["token_ids"][:2]) for p in warmups}


def test_every_level_gets_a_warmup_batch_as_wide_as_itself() -> None:
    warmups = [{"id": f"w{i}", "token_ids": [i]} for i in range(3)]
    batches = h200_serve.warmup_batches(warmups, [1, 4, 16])
    assert [len(b) for b in batches] == [1, 4, 16]
    assert {p["id"] for p in batches[2]} == {"w0", "w1", "w2"}


@pytest.fixture(scope="module")
def loopback(tmp_path_factory) -> Iterator[Server]:
    server = start_loopback(ttft_ms=5.0, itl_ms=2.0, log_path=tmp_path_factory.mktemp("loopback") / "server.log")
    server.spec.engine = "sglang"   # the loopback speaks SGLang's streamed /generate: the SGLang adapter sends to it
    try:
        yield server
    finally:
        server.stop()


def test_a_pass_records_its_fields_from_the_harness_clients_records(loopback: Server) -> None:
    prompts = [{"id": f"chat/p{i}", "token_ids": [100 + i, 7, i]} for i in range(5)]
    before = set(sent_times(loopback))
    result = h200_serve.run_pass(loopback, prompts, 2, 6, None)
    assert set(result) == {"concurrency", "wall_s", "output_tokens", "tok_s", "accept_length_mean_per_request",
                           "accept_length_tokens_per_verify", "requests"}
    assert result["concurrency"] == 2 and result["output_tokens"] == 30
    assert result["tok_s"] == pytest.approx(30 / result["wall_s"])
    assert result["accept_length_mean_per_request"] is None and result["accept_length_tokens_per_verify"] is None
    assert [r["id"] for r in result["requests"]] == [p["id"] for p in prompts]   # the prompts' order
    for r in result["requests"]:
        assert set(r) == {"id", "output_ids", "text", "completion_tokens", "spec_verify_ct", "spec_accept_length",
                          "latency_s"}
        assert r["output_ids"] == list(range(6)) and r["completion_tokens"] == 6 and r["text"].endswith(" w5")
        assert r["spec_verify_ct"] is None and 0 < r["latency_s"] < result["wall_s"]
    sent = [v["prompt"] for k, v in sent_times(loopback).items() if k not in before]
    assert sorted(sent) == sorted(json.dumps(p["token_ids"]) for p in prompts)   # each prompt once, as token ids


def test_a_warmup_batch_may_send_a_prompt_twice(loopback: Server) -> None:
    batch = h200_serve.warmup_batches([{"id": "w0", "token_ids": [1, 2]}, {"id": "w1", "token_ids": [3]}], [3])[0]
    records, _ = h200_serve.generate_all(loopback, batch, 3, 2)
    assert [r.prompt_token_ids for r in records] == [[1, 2], [3], [1, 2]]


def test_a_failed_request_fails_the_batch(loopback: Server, monkeypatch) -> None:
    monkeypatch.setattr(SGLangAdapter, "stream_request", lambda self, ids, *a, **k: ("/missing", {"input_ids": ids}))
    with pytest.raises(h200_serve.RequestFailed, match="1 of 1 requests failed.*http_404"):
        h200_serve.generate_all(loopback, [{"id": "p0", "token_ids": [1]}], 1, 4)
