"""Multi-turn regeneration: the target answers each user turn of a conversation with its own earlier answers in
context, turn by turn (all conversations' turn 1, then all turn 2s, ...), as a multi-turn workload sends them.

The request of turn k is rendered exactly as the workload client renders it (harness/workloads/render.py: the
prefix, the user turns and the target's decoded answers, the chat template with the generation prompt). The
engine is a `Generate`: prompt token ids in, (answer ids ending with the end-of-turn token when finished,
finished) out — transformers' batched greedy `generate` here, SGLang's offline engine on a GPU host
(sglang_regen.py). A conversation stops at the first turn whose request exceeds `max_context_tokens`.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from experiments.harness.workloads.formats import Conversation
from experiments.harness.workloads.render import render_turn, turn_messages

Generate = Callable[[list[list[int]]], list[tuple[list[int], bool]]]


def answer_text(tok, response_ids: list[int]) -> str:
    """The answer as a client receives it (special tokens, the end-of-turn one included, dropped)."""
    return tok.decode(response_ids, skip_special_tokens=True)


def regenerate(convs: list[tuple[Conversation, str]], tok, generate: Generate, max_turns: int,
               max_context_tokens: int, progress: Callable[[str], None] = print) -> list[dict]:
    """Rows {id, kind, turn, messages, prompt_ids, response_ids, finished}, one per answered turn, for
    `convs` = [(conversation, kind)]; turn k's messages hold the target's own answers to turns 0..k-1."""
    answers: list[list[str]] = [[] for _ in convs]
    active = list(range(len(convs)))
    rows: list[dict] = []
    t0 = time.time()
    for turn in range(max_turns):
        todo = []
        for i in active:
            conv = convs[i][0]
            if turn < len(conv.user_turns):
                ids = render_turn(tok, conv, turn, answers[i])
                if len(ids) <= max_context_tokens:
                    todo.append((i, ids))
        if not todo:
            break
        outs = generate([ids for _, ids in todo])
        for (i, ids), (resp, finished) in zip(todo, outs, strict=True):
            conv, kind = convs[i]
            rows.append({"id": f"{conv.id}/t{turn}", "kind": kind, "turn": turn,
                         "messages": turn_messages(conv, turn, answers[i]), "prompt_ids": ids,
                         "response_ids": [int(t) for t in resp], "finished": bool(finished)})
            answers[i].append(answer_text(tok, resp))
        active = [i for i, _ in todo]
        progress(f"eagle3 regen: turn {turn + 1}: {len(todo)} answers, {len(rows)} in all, {time.time() - t0:.0f}s")
    return rows


def transformers_generate(model, tok, max_new_tokens: int, batch_size: int,
                          progress: Callable[[str], None] = print) -> Generate:
    """The trainer's own engine: batched greedy `generate` (data.greedy_answers) on the model's device."""
    from experiments.eagle3.data import greedy_answers

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        rows = [{"prompt_ids": p} for p in prompts]
        greedy_answers(model, tok, rows, max_new_tokens, batch_size, progress)
        return [(r["response_ids"], r["finished"]) for r in rows]

    return generate


def conversation_record(conv: Conversation, kind: str) -> dict:
    """A conversation as JSON (what the SGLang subprocess reads back with `from_record`)."""
    return {"kind": kind, **conv.content(), "source": conv.source}


def from_record(d: dict) -> tuple[Conversation, str]:
    return Conversation(d["id"], d["category"], tuple(d["prefix"]), tuple(d["user_turns"]), d["raw_prompt"],
                        d["source"]), d["kind"]
