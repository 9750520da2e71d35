"""Conversations -> token ids, client-side with the model's tokenizer, so every engine sees identical inputs;
and the check that a workload fits the served context."""
from __future__ import annotations

import logging

from experiments.harness.workloads.formats import Conversation, WorkloadError, refuse

log = logging.getLogger(__name__)


def turn_messages(conv: Conversation, turn: int, answers: list[str]) -> list[dict]:
    """The chat history of request `turn` (0-based): prefix, then user/assistant pairs, ending on the user."""
    if not 0 <= turn < len(conv.user_turns):
        raise ValueError(f"{conv.source}: turn {turn} out of range ({len(conv.user_turns)} user turns)")
    if len(answers) < turn:
        raise ValueError(f"{conv.source}: turn {turn} needs the model's {turn} previous answer(s), got {len(answers)}")
    msgs = list(conv.prefix)
    for i in range(turn):
        msgs += [{"role": "user", "content": conv.user_turns[i]}, {"role": "assistant", "content": answers[i]}]
    return msgs + [{"role": "user", "content": conv.user_turns[turn]}]


def render_turn(tokenizer, conv: Conversation, turn: int, answers: list[str]) -> list[int]:
    """Token ids of request `turn`; `answers` are the model's own answers to the earlier turns."""
    if conv.raw_prompt is not None:
        if turn != 0:
            raise ValueError(f"{conv.source}: a raw prompt has one turn, asked for turn {turn}")
        return [int(i) for i in tokenizer(conv.raw_prompt)["input_ids"]]
    ids = tokenizer.apply_chat_template(turn_messages(conv, turn, answers), add_generation_prompt=True,
                                        tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def budgets(tokenizer, items: list[tuple[Conversation, int]], max_tokens: int) -> list[int]:
    """Per (conversation, turns): the tokens its first `turns` turns can need: the last request with empty
    answers plus max_tokens for each answer (the earlier ones sit in the last request, the last is generated).
    One batched tokenizer call: apply_chat_template(tokenize=True) is the rendered text tokenized without
    special tokens, so the counts are render_turn's."""
    chat = [i for i, (c, _) in enumerate(items) if c.raw_prompt is None]
    texts = [tokenizer.apply_chat_template(turn_messages(c, t - 1, [""] * (t - 1)), add_generation_prompt=True,
                                           tokenize=False) for c, t in (items[i] for i in chat)]
    raw = [i for i, (c, _) in enumerate(items) if c.raw_prompt is not None]
    lengths = [0] * len(items)
    if chat:
        for i, ids in zip(chat, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True):
            lengths[i] = len(ids)
    if raw:
        for i, ids in zip(raw, tokenizer([items[i][0].raw_prompt for i in raw])["input_ids"], strict=True):
            lengths[i] = len(ids)
    return [n + t * max_tokens for n, (_, t) in zip(lengths, items, strict=True)]


def fitting_turns(tokenizer, convs: list[Conversation], max_model_len: int, max_tokens: int) -> list[int]:
    """How many leading turns of each conversation fit (0: not even the first)."""
    full = budgets(tokenizer, [(c, c.num_turns) for c in convs], max_tokens)
    out = [c.num_turns if b <= max_model_len else 0 for c, b in zip(convs, full, strict=True)]
    shorter = [(i, t) for i, c in enumerate(convs) if not out[i] for t in range(1, c.num_turns)]
    for (i, t), b in zip(shorter, budgets(tokenizer, [(convs[i], t) for i, t in shorter], max_tokens), strict=True):
        if b <= max_model_len:
            out[i] = max(out[i], t)
    return out


def fit_to_context(convs: list[Conversation], tokenizer, max_model_len: int, max_tokens: int, cut: bool,
                   counts: dict[str, int] | None = None) -> list[Conversation]:
    """Conversations that fit `max_model_len`. cut=False (the user's files): refuse any that do not, naming
    them. cut=True (ShareGPT): drop later turns until the conversation fits, skip one whose first turn does
    not. `counts`, when given, receives kept / turns_dropped / skipped."""
    kept, problems, dropped, skipped = [], [], 0, 0
    for conv, turns in zip(convs, fitting_turns(tokenizer, convs, max_model_len, max_tokens), strict=True):
        if turns == conv.num_turns:
            kept.append(conv)
        elif not cut:
            problems.append(_too_long(tokenizer, conv, turns, max_model_len, max_tokens))
        elif turns == 0:
            skipped += 1
        else:
            kept.append(conv.first_turns(turns))
            dropped += conv.num_turns - turns
    if problems:
        raise refuse(f"prompts longer than the context (max_model_len={max_model_len}, max_tokens={max_tokens})",
                     problems)
    if cut and (dropped or skipped):
        log.info("cut to context %d: %d later turns dropped, %d conversations skipped (first turn too long)",
                 max_model_len, dropped, skipped)
    if counts is not None:
        counts.update(kept=len(kept), turns_dropped=dropped, skipped=skipped)
    if not kept:
        raise WorkloadError(f"no conversation fits max_model_len={max_model_len} with max_tokens={max_tokens}")
    return kept


def _too_long(tokenizer, conv: Conversation, turns: int, max_model_len: int, max_tokens: int) -> str:
    first = len(render_turn(tokenizer, conv, 0, []))
    if turns == 0:
        return (f"{conv.source} ({conv.id}): the first request is {first} tokens + max_tokens {max_tokens} > "
                f"max_model_len {max_model_len}; shorten the prompt, lower max_tokens or raise the context")
    need = budgets(tokenizer, [(conv, conv.num_turns)], max_tokens)[0]
    return (f"{conv.source} ({conv.id}): {conv.num_turns} turns need up to {need} tokens (answers at max_tokens "
            f"{max_tokens}) > max_model_len {max_model_len}; only {turns} fit: set workload.max_turns={turns}, "
            "lower max_tokens or raise the context")
