"""Offline n-gram replay: a brute-force reference, vLLM's own proposer, real token sequences, bad input."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import mlflow
import numpy as np
import pytest
from conftest import SMOLLM2, VLLM_PYTHON, run_fixed
from mlflow.tracking import MlflowClient

from experiments.analysis.replay import (
    NgramConfig,
    NgramIndex,
    ReplayInputError,
    ReplaySequence,
    main,
    parse_grid,
    replay_config,
    replay_workload,
    sequences_from_records,
)


def brute_propose(ctx: list[int], cfg: NgramConfig, max_model_len: int) -> list[int]:
    """vLLM's rule written the slow way: longest suffix (<= max) seen earlier with a token after it,
    earliest occurrence, none below min."""
    n = len(ctx)
    k = min(cfg.k, max_model_len - n)
    if n < cfg.min_match or k <= 0:
        return []
    for length in range(min(cfg.max_match, n - 1), 0, -1):
        for p in range(0, n - length):
            if ctx[p:p + length] == ctx[n - length:]:
                if length < cfg.min_match:
                    return []
                s = p + length
                return ctx[s:s + min(k, n - s)]
    return []


def brute_replay(seq: ReplaySequence, cfg: NgramConfig, max_model_len: int) -> tuple:
    full = seq.prompt_ids + seq.output_ids
    pos, steps, drafts, draft_tokens, accepted = len(seq.prompt_ids) + 1, 0, 0, 0, 0
    per_pos = [0] * cfg.k
    while pos < len(full):
        draft = brute_propose(full[:pos], cfg, max_model_len)
        a = 0
        while a < len(draft) and pos + a < len(full) and draft[a] == full[pos + a]:
            a += 1
        steps += 1
        if draft:
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(draft), accepted + a
            for i in range(a):
                per_pos[i] += 1
        pos += a + 1
    return steps, drafts, draft_tokens, accepted, per_pos


def random_workload(rng: random.Random) -> list[ReplaySequence]:
    vocab = rng.choice([2, 3, 5, 30])
    return [ReplaySequence([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))],
                           [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))], f"r{i}")
            for i in range(rng.randrange(1, 5))]


def test_replay_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(250):
        seqs = random_workload(rng)
        lo = rng.randint(1, 3)
        cfg = NgramConfig(lo, rng.randint(lo, 5), rng.randint(1, 6))
        max_model_len = rng.choice([2048, 35])
        got = replay_config(NgramIndex(seqs, cfg.max_match), cfg, max_model_len)
        for seq, stats in zip(seqs, got, strict=True):
            assert (stats.steps, stats.drafts, stats.draft_tokens, stats.accepted, stats.per_pos) == \
                brute_replay(seq, cfg, max_model_len), (cfg, seq)
            checked += stats.drafts
    assert checked > 500  # the random workloads did exercise drafting


@pytest.fixture(scope="module")
def real_sequences() -> list[ReplaySequence]:
    """SmolLM2-tokenised prompts of the grounded set with outputs that copy, edit and paraphrase them."""
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.fail("SmolLM2 tokenizer missing; run bin/setup")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    rows = [json.loads(line) for line in (Path("experiments/prompt_sets/grounded.jsonl")).read_text().splitlines()]
    rng = random.Random(3)
    seqs = []
    for row in rows:
        text = row.get("prompt") or row["messages"][-1]["content"]
        words = text.split()
        out = " ".join(w if rng.random() > 0.15 else rng.choice(["river", "the", "quickly", "data"]) for w in words)
        seqs.append(ReplaySequence(tok(text)["input_ids"], tok(out)["input_ids"][:160], row["id"]))
    return seqs


def test_replay_matches_brute_force_on_real_sequences(real_sequences) -> None:
    for cfg in (NgramConfig(2, 4, 4), NgramConfig(1, 3, 8), NgramConfig(3, 5, 2)):
        got = replay_config(NgramIndex(real_sequences, cfg.max_match), cfg)
        for seq, stats in zip(real_sequences, got, strict=True):
            assert (stats.steps, stats.drafts, stats.draft_tokens, stats.accepted, stats.per_pos) == \
                brute_replay(seq, cfg, 2048)
    total = replay_workload(real_sequences, [NgramConfig(2, 4, 4)])[NgramConfig(2, 4, 4)]["total"]
    assert total.acceptance().accept_length > 2.0  # copied text is drafted and accepted


VLLM_PROPOSE = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose
job = json.load(sys.stdin)
out = []
for tokens in job["sequences"]:
    arr = np.asarray(tokens, dtype=np.int32)
    out.append([propose(arr[:n], job["min"], job["max"], job["max_model_len"], job["k"]).tolist()
                for n in range(1, len(arr))])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_drafts_equal_vllm_proposer(real_sequences) -> None:
    """vLLM 0.32's own numba proposer, in its venv, on every context of real and random sequences."""
    if not VLLM_PYTHON.exists():
        pytest.fail("vLLM venv missing; run bin/setup")
    rng = random.Random(11)
    seqs = real_sequences[:4] + [ReplaySequence([rng.randrange(4) for _ in range(30)],
                                                [rng.randrange(4) for _ in range(50)]) for _ in range(4)]
    for cfg, max_model_len in ((NgramConfig(2, 4, 4), 2048), (NgramConfig(1, 5, 7), 60)):
        job = {"sequences": [s.prompt_ids + s.output_ids for s in seqs], "min": cfg.min_match,
               "max": cfg.max_match, "k": cfg.k, "max_model_len": max_model_len}
        proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_PROPOSE], input=json.dumps(job), text=True,
                              capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        vllm_drafts = json.loads(proc.stdout.strip().splitlines()[-1])
        index = NgramIndex(seqs, cfg.max_match)
        start, length = index.proposals(cfg, max_model_len)
        mine = {int(q): index.tokens[s:s + n].tolist() for q, s, n in zip(index.query, start, length, strict=True)}
        compared = 0
        for r, drafts in enumerate(vllm_drafts):
            base = int(index.starts[r])
            for n in range(len(seqs[r].prompt_ids) + 1, len(drafts) + 1):   # contexts a decode step sees
                assert mine[base + n] == drafts[n - 1], (cfg, r, n)
                compared += bool(drafts[n - 1])
        assert compared > 50


def test_parse_grid() -> None:
    configs = parse_grid(["min_match=1,3", "max_match=2,4", "num_draft_tokens=4"])
    assert {(c.min_match, c.max_match, c.k) for c in configs} == {(1, 2, 4), (1, 4, 4), (3, 4, 4)}
    for bad in (["k=0"], ["depth=3"], ["k=a"], ["min_match=5", "max_match=2"]):
        with pytest.raises(ReplayInputError):
            parse_grid(bad)


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record(prompt: list[int], output: list[int], conc: int = 1, **extra) -> dict:
    return {"concurrency": conc, "repetition": 0, "prompt_id": "p", "prompt_token_ids": prompt,
            "output_token_ids": output, "chunk_tokens": [], "error": None, **extra}


def runs_in(store: str) -> list:
    mlflow.set_tracking_uri(store)
    client = MlflowClient()
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def test_bad_inputs_are_refused_and_nothing_is_written(tmp_path: Path, store: str, capsys) -> None:
    no_ids = write_records(tmp_path / "noids.jsonl", [{"concurrency": 1, "prompt_id": "p", "text": "hi"}])
    empty = write_records(tmp_path / "empty.jsonl", [])
    failed = write_records(tmp_path / "failed.jsonl", [record([1, 2], [], error="HTTP 500")])
    cases = {str(no_ids): "token ids", str(empty): "empty workload", str(failed): "none of the 1 requests",
             "0123456789abcdef0123456789abcdef": "neither a records file nor a run"}
    for source, message in cases.items():
        assert main([source, "--tracking-uri", store]) == 2
        assert message in capsys.readouterr().err
    assert runs_in(store) == []
    with pytest.raises(ReplayInputError, match="token ids"):
        sequences_from_records([record([], [1])], "x")


def test_replay_run_logged_from_records(tmp_path: Path, store: str) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, 120).tolist()
    recs = [record(prompt, prompt[10:60] + rng.integers(0, 500, 20).tolist() + prompt[70:110], conc)
            for conc in (1, 4)]
    path = write_records(tmp_path / "records.jsonl", recs)
    assert main([str(path), "min_match=1,2", "max_match=3,4", "k=2,4", "--tracking-uri", store,
                 "--experiment", "replays"]) == 0
    (run,) = runs_in(store)
    client = MlflowClient()
    assert run.info.status == "FINISHED" and run.data.tags["specws.mode"] == "replay"
    assert run.data.tags["specws.replay_of"] == str(path.resolve())
    assert run.data.params["grid.k"] == "2,4" and run.data.params["grid.min_match"] == "1,2"
    assert run.data.metrics["min2_max4_k4/accept_length"] > 3.0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"replay.json", "plots/replay_heatmap.png"} <= artifacts
    replay = json.loads(Path(client.download_artifacts(run.info.run_id, "replay.json", str(tmp_path))).read_text())
    assert set(replay) == {f"min{a}_max{b}_k{k}" for a in (1, 2) for b in (3, 4) for k in (2, 4)}
    assert set(replay["min2_max4_k4"]["levels"]) == {"1", "4"}


def test_replay_of_a_run_id_links_both_runs(tmp_path: Path, store: str) -> None:
    """Records written by the workspace client (against the loopback server) as a run's artifacts."""
    from experiments.engines.vllm_engine import VLLMAdapter
    from tests.helpers.loopback_server import start_loopback
    server = start_loopback(ttft_ms=1.0, itl_ms=0.5)
    try:
        path = tmp_path / "records.jsonl"
        # prompts that hold the loopback's output ids 0..31, so the replay finds drafts to accept
        run_fixed(server, VLLMAdapter(), 32, path, {f"p{i}": [900 + i, *range(40)] for i in range(3)}, [1])
    finally:
        server.stop()
    mlflow.set_tracking_uri(store)
    client = MlflowClient()
    source = client.create_run(client.create_experiment("measured"), tags={"specws.workload": "loopback"})
    client.log_artifact(source.info.run_id, str(path), "records")
    client.set_terminated(source.info.run_id, "FINISHED")
    assert main([source.info.run_id, "k=4", "min_match=2", "max_match=3", "--tracking-uri", store]) == 0
    replay = next(r for r in runs_in(store) if r.data.tags.get("specws.mode") == "replay")
    assert replay.info.experiment_id == source.info.experiment_id
    assert replay.data.tags["specws.replay_of"] == source.info.run_id
    assert replay.data.tags["specws.workload"] == "loopback"
    assert client.get_run(source.info.run_id).data.tags["specws.last_replay_run_id"] == replay.info.run_id
    assert replay.data.metrics["min2_max3_k4/accept_length"] == pytest.approx(5.0)  # every draft accepted
