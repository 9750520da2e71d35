"""Workloads: every file format (JSONL and JSON arrays), refusals naming file:line, mixed built-in sets, the
ShareGPT sample, rendering with the real tokenizer, and the visit plan's invariants."""
from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import SMOLLM2

from experiments.harness.workloads.formats import Conversation, WorkloadError, load_file
from experiments.harness.workloads.loader import load_workload, prompt_set_digest, prompt_set_files
from experiments.harness.workloads.render import budgets, fit_to_context, render_turn
from experiments.harness.workloads.sampling import plan_visits
from experiments.harness.workloads.sharegpt import sample_sharegpt, sharegpt_path

SPECBENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now make it rhyme."]},
             {"question_id": 82, "category": "math", "turns": ["What is 2+2?"], "reference": ["4"]}]
SHAREGPT = [{"id": "a_0", "conversations": [{"from": "system", "value": "Be brief."},
                                            {"from": "human", "value": "Hi there"},
                                            {"from": "gpt", "value": "Hello!"},
                                            {"from": "human", "value": "Tell me a joke"}]},
            {"id": "b_0", "conversations": [{"from": "human", "value": "Name a colour"}]}]
MESSAGES = [{"id": "m1", "messages": [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Hello"},
                                      {"role": "assistant", "content": "Hi."},
                                      {"role": "user", "content": "Capital of France?"}]},
            {"id": "m2", "category": "geo", "messages": [{"role": "user", "content": "Largest ocean?"}]}]
PROMPTS = [{"id": "p1", "prompt": "Once upon a time"}, {"prompt": "The quick brown fox"}]
BROKEN = {  # format -> (good rows, a broken second row, what the message says)
    "specbench": (SPECBENCH, {"question_id": 83, "turns": []}, "'turns' must be a non-empty list"),
    "sharegpt": (SHAREGPT, {"id": "c", "conversations": [{"from": "gpt", "value": "x"}]}, "must be from human"),
    "messages": (MESSAGES, {"messages": [{"role": "assistant", "content": "x"}]}, "last message must have role"),
    "prompt": (PROMPTS, {"prompt": 5}, "must be a string"),
}


def write(path: Path, rows: list, array: bool = False) -> Path:
    if array:
        path.write_text(json.dumps(rows, indent=2))
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


@pytest.fixture(scope="module")
def tok():
    if not (SMOLLM2 / "config.json").exists():
        pytest.fail(f"{SMOLLM2} missing; run bin/setup")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(SMOLLM2))


def convs_of(n: int, categories: tuple[str, ...] = ("chat", "code", "math")) -> list[Conversation]:
    return [Conversation(f"q{i}", categories[i % len(categories)], (), (f"question {i}",), None, f"f:{i + 1}")
            for i in range(n)]


# --- formats ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("array", [False, True], ids=["jsonl", "json"])
def test_each_format_loads(tmp_path: Path, array: bool) -> None:
    spec = load_file(write(tmp_path / "question.jsonl", SPECBENCH, array))
    assert [(c.id, c.category, c.user_turns) for c in spec] == [
        ("81", "writing", ("Write a poem.", "Now make it rhyme.")), ("82", "math", ("What is 2+2?",))]
    share = load_file(write(tmp_path / "sg.json", SHAREGPT, array))
    assert share[0].prefix == ({"role": "system", "content": "Be brief."},)
    assert share[0].user_turns == ("Hi there", "Tell me a joke") and share[0].category == "conversation"
    msgs = load_file(write(tmp_path / "chat.jsonl", MESSAGES, array))
    assert len(msgs[0].prefix) == 3 and msgs[0].user_turns == ("Capital of France?",)
    assert [c.category for c in msgs] == ["chat", "geo"]  # no category: the file's stem
    raw = load_file(write(tmp_path / "raw.jsonl", PROMPTS, array))
    assert raw[0].raw_prompt == "Once upon a time" and raw[0].user_turns == ()
    assert raw[1].id != raw[0].id and raw[1].source.startswith(f"{tmp_path / 'raw.jsonl'}:")


def test_sources_name_the_line(tmp_path: Path) -> None:
    jsonl = load_file(write(tmp_path / "a.jsonl", [{"prompt": "x"}, {"prompt": "y"}]))
    assert [c.source.rsplit(":", 1)[1] for c in jsonl] == ["1", "2"]
    array = load_file(write(tmp_path / "b.json", [{"prompt": "x"}, {"prompt": "y"}], array=True))
    assert [c.source.rsplit(":", 1)[1] for c in array] == ["2", "5"]  # indent=2: each object on 3 lines


@pytest.mark.parametrize("fmt", sorted(BROKEN))
@pytest.mark.parametrize("array", [False, True], ids=["jsonl", "json"])
def test_broken_row_refused_naming_file_and_line(tmp_path: Path, fmt: str, array: bool) -> None:
    good, bad, says = BROKEN[fmt]
    path = write(tmp_path / "set.json", [good[0], bad], array)
    with pytest.raises(WorkloadError, match=says) as err:
        load_file(path)
    text = str(err.value)
    assert "nothing loaded" in text
    assert (f"{path}:" in text and "(element 1)" in text) if array else f"{path}:2: " in text


def test_malformed_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "no end}\n')
    with pytest.raises(WorkloadError, match=rf"{path}:2:\d+: malformed JSON"):
        load_file(path)
    array = tmp_path / "bad.json"
    array.write_text('[\n {"prompt": "ok"},\n {"prompt": }\n]')
    with pytest.raises(WorkloadError, match=rf"{array}:3:\d+: malformed JSON .*element 1"):
        load_file(array)


def test_unknown_rows_say_which_keys_and_what_each_format_needs(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"has keys \['foo'\].*specbench: question_id, turns.*prompt: prompt"):
        load_file(write(tmp_path / "x.jsonl", [{"foo": 1}]))
    with pytest.raises(WorkloadError, match=r":2: the row has keys \['text'\]; format messages needs messages"):
        load_file(write(tmp_path / "y.jsonl", [MESSAGES[0], {"text": "x"}]))
    with pytest.raises(WorkloadError, match=r"format prompt needs prompt"):
        load_file(write(tmp_path / "z.jsonl", MESSAGES), fmt="prompt")


def test_wrong_types_are_refused(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "user", "content": ""}]},
            {"messages": "hello"}, {"id": [1], "messages": [{"role": "user", "content": "x"}]}]
    with pytest.raises(WorkloadError) as err:
        load_file(write(tmp_path / "t.jsonl", rows))
    text = str(err.value)
    assert "4 problem(s)" in text and "system|user|assistant" in text and "is empty" in text
    assert "'id' must be a string or an integer" in text


def test_duplicates_empty_and_many_problems(tmp_path: Path) -> None:
    dup = write(tmp_path / "d.jsonl", [PROMPTS[0], {"prompt": "x"}, PROMPTS[0]])
    with pytest.raises(WorkloadError, match=rf"{dup}:3: duplicate id 'p1' \(first at {dup}:1\)"):
        load_file(dup)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(WorkloadError, match="empty"):
        load_file(empty)
    (tmp_path / "f.json").write_text("[]")
    with pytest.raises(WorkloadError, match="empty"):
        load_file(tmp_path / "f.json")
    many = write(tmp_path / "m.jsonl", [{"prompt": ""}] * 13)
    with pytest.raises(WorkloadError, match=r"m.jsonl \(format prompt\): 13 problem(?s:.*)\n  - and 3 more$"):
        load_file(many)


def test_max_turns_keeps_the_first_user_turns(tmp_path: Path) -> None:
    convs = load_file(write(tmp_path / "q.jsonl", SPECBENCH), max_turns=1)
    assert [c.user_turns for c in convs] == [("Write a poem.",), ("What is 2+2?",)]
    with pytest.raises(WorkloadError, match="max_turns"):
        load_file(tmp_path / "q.jsonl", max_turns=0)


# --- loader ----------------------------------------------------------------------------------------------------

def test_mixed_sets(tmp_path: Path) -> None:
    chat, mixed = load_workload("chat"), load_workload("chat,math")
    assert len(mixed) == len(chat) + len(load_workload("math"))
    assert {c.id.split("/", 1)[0] for c in mixed} == {"chat", "math"}
    assert prompt_set_digest(mixed) == prompt_set_digest(list(reversed(load_workload("chat,math"))))
    assert prompt_set_digest(mixed) != prompt_set_digest(chat)
    assert [p.stem for p in prompt_set_files("chat,math")] == ["chat", "math"]
    a, b = write(tmp_path / "a.jsonl", PROMPTS), write(tmp_path / "b.json", PROMPTS, array=True)
    both = load_workload(f"{a},{b}")  # the same ids in two sets: each keeps its set's name
    assert {c.id for c in both} >= {"a/p1", "b/p1"} and {c.category for c in both} == {"a", "b"}
    with pytest.raises(WorkloadError, match="not a built-in set"):
        load_workload("chat,nosuchset")
    with pytest.raises(WorkloadError, match="names a set twice"):
        load_workload("chat,chat")


def test_num_prompts_is_a_seeded_stratified_sample(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "category": "abcc"[i % 4], "prompt": f"text {i}"} for i in range(40)]
    path = write(tmp_path / "mine.jsonl", rows)
    a = load_workload(str(path), num_prompts=8, seed=3)
    assert Counter(c.category for c in a) == {"a": 2, "b": 2, "c": 4}
    assert [c.id for c in a] == [c.id for c in load_workload(str(path), num_prompts=8, seed=3)]
    assert {c.id for c in a} != {c.id for c in load_workload(str(path), num_prompts=8, seed=4)}
    assert len(load_workload("chat,code", num_prompts=6, seed=0)) == 6
    with pytest.raises(WorkloadError, match="num_prompts=99"):
        load_workload(str(path), num_prompts=99)
    array = write(tmp_path / "mine.json", SPECBENCH, array=True)
    assert [c.id for c in load_workload(str(array))] == ["81", "82"]
    assert prompt_set_files(str(array)) == [array]


# --- ShareGPT --------------------------------------------------------------------------------------------------

def test_sharegpt_sample_is_seeded(tok) -> None:
    assert sharegpt_path().stat().st_size > 100_000_000
    a, b = sample_sharegpt(12, 1, 2), sample_sharegpt(12, 1, 2)
    assert [c.id for c in a] == [c.id for c in b] and len({c.id for c in a}) == 12
    assert {c.id for c in a} != {c.id for c in sample_sharegpt(12, 2, 2)}
    assert all(c.category == "conversation" and 1 <= len(c.user_turns) <= 2 for c in a)
    assert [c.id for c in load_workload("sharegpt", num_prompts=12, seed=1, max_turns=2)] == [c.id for c in a]
    counts: dict[str, int] = {}
    fitted = fit_to_context(sample_sharegpt(40, 0, None), tok, 512, 64, cut=True, counts=counts)
    assert counts["turns_dropped"] > 0 and counts["kept"] == len(fitted)
    for conv in fitted:
        last = len(conv.user_turns) - 1
        assert len(render_turn(tok, conv, last, [""] * last)) + 64 * (last + 1) <= 512


def test_user_file_too_long_is_refused(tmp_path: Path, tok) -> None:
    path = write(tmp_path / "long.jsonl", [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 600}])
    with pytest.raises(WorkloadError, match=rf"{path}:2 \(long\): the first request is \d+ tokens \+ max_tokens 64"):
        fit_to_context(load_file(path), tok, 512, 64, cut=False)
    two = write(tmp_path / "two.jsonl", [{"question_id": 1, "turns": ["hi", "word " * 400]}])
    with pytest.raises(WorkloadError, match=r"only 1 fit: set workload.max_turns=1"):
        fit_to_context(load_file(two), tok, 512, 64, cut=False)


# --- rendering -------------------------------------------------------------------------------------------------

def test_multi_turn_rendering_includes_the_previous_answer(tmp_path: Path, tok) -> None:
    conv = load_file(write(tmp_path / "sg.jsonl", SHAREGPT))[0]
    first = render_turn(tok, conv, 0, [])
    second = tok.decode(render_turn(tok, conv, 1, ["A PENGUIN WALKS IN"]))
    assert tok.decode(first) in second  # the first request is a prefix of the second
    assert second.index("Be brief.") < second.index("Hi there") < second.index("A PENGUIN WALKS IN") \
        < second.index("Tell me a joke")
    assert "Hello!" not in second  # the dataset's own answers are never replayed
    assert budgets(tok, [(conv, 2), (conv, 1)], 10) == [len(render_turn(tok, conv, 1, [""])) + 20, len(first) + 10]
    with pytest.raises(ValueError, match="previous answer"):
        render_turn(tok, conv, 1, [])
    raw = load_file(write(tmp_path / "raw.jsonl", PROMPTS))[0]
    assert render_turn(tok, raw, 0, []) == tok("Once upon a time")["input_ids"]


# --- visit plan ------------------------------------------------------------------------------------------------

def ids(convs: list[Conversation]) -> list[str]:
    return [c.id for c in convs]


def test_plan_slices_are_disjoint_stratified_and_warmups_apart() -> None:
    convs = convs_of(60)
    plan = plan_visits(convs, [1, 4, 8], 2, 3, seed=0)
    slices = [set(ids(s)) for s in plan.measured.values()]
    assert sorted(plan.measured) == [(1, 0), (1, 1), (4, 0), (4, 1), (8, 0), (8, 1)]
    assert sum(len(s) for s in slices) == len(set().union(*slices)) == 57
    warm = set(ids(plan.warmup))
    assert len(warm) == 3 and not warm & set().union(*slices) and len({c.category for c in plan.warmup}) == 3
    assert {k: len(v) for k, v in plan.level_warmup.items()} == {4: 4, 8: 8}
    assert all(set(ids(b)) <= warm for b in plan.level_warmup.values())
    for s in plan.measured.values():
        assert max(Counter(c.category for c in s).values()) - min(Counter(c.category for c in s).values()) <= 1
    assert {len(s) for s in slices} <= {9, 10}
    assert plan.describe()["measured_conversations"] == 57 and plan.describe()["level_warmup.c8"] == 8


def test_plan_is_deterministic_and_seeded() -> None:
    convs = convs_of(40)
    shuffled = random.Random(5).sample(convs, len(convs))
    a, b = plan_visits(convs, [1, 2], 2, 2, seed=7), plan_visits(shuffled, [1, 2], 2, 2, seed=7)
    assert {k: ids(v) for k, v in a.measured.items()} == {k: ids(v) for k, v in b.measured.items()}
    assert ids(a.warmup) == ids(b.warmup)
    c = plan_visits(convs, [1, 2], 2, 2, seed=8)
    assert {k: ids(v) for k, v in a.measured.items()} != {k: ids(v) for k, v in c.measured.items()}
    assert plan_visits(convs, [1], 1, 0, seed=0).level_warmup == {}


def test_reuse_and_num_prompts() -> None:
    convs = convs_of(20)
    plan = plan_visits(convs, [1, 4], 3, 2, seed=0, reuse=True)
    assert all(sorted(ids(s)) == sorted(set(ids(convs)) - set(ids(plan.warmup))) for s in plan.measured.values())
    assert plan.describe()["reuse_prompts"] is True and plan.describe()["measured_visits"] == 6 * 18
    sampled = plan_visits(convs, [1, 2], 1, 2, seed=0, num_prompts=9)
    measured = [c for s in sampled.measured.values() for c in s]
    assert len(measured) == 9 and not set(ids(measured)) & set(ids(sampled.warmup))


def test_plan_refuses_when_too_small() -> None:
    with pytest.raises(WorkloadError, match=r"concurrency 4, repetition 0 gets 3.*need at least 50 prompts "
                                            r"\(2 \+ 3 x 2 x 8\).*has 20.*reuse_prompts=true"):
        plan_visits(convs_of(20), [1, 4, 8], 2, 2, seed=0)
    with pytest.raises(WorkloadError, match="leaves nothing to measure"):
        plan_visits(convs_of(3), [1], 1, 3, seed=0)
    with pytest.raises(WorkloadError, match="fewer than concurrency 8; need at least 10"):
        plan_visits(convs_of(6), [8], 1, 2, seed=0, reuse=True)
    with pytest.raises(WorkloadError, match="num_prompts=30"):
        plan_visits(convs_of(20), [1], 1, 2, seed=0, num_prompts=30)
