"""Offline routing of the small MoE (HF forward with router hooks): continuations, per-token expert picks,
distinct experts per forward step for decode vs verification, and budgeted speculative decoding.

A causal forward routes each token the same whether it is computed alone or inside a longer forward, so
one forward over prompt + continuation gives every token's top-k picks; a step's distinct experts are the
union over the tokens that step carries: decode at concurrency c = one token from each of c sequences;
verification with k draft tokens at concurrency c = k+1 consecutive tokens from each of c sequences
(the continuation's own tokens stand in for the drafts: fully accepted drafts).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from experiments.moe.model import routing_hooks
from sglang_patches.moe_budget import budget_topk


@torch.no_grad()
def greedy_continuations(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None) -> list[list[int]]:
    """Each prompt's greedy continuation (one sequence at a time: no padding effects), without EOS."""
    out = []
    for ids in prompts:
        gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id,
                             pad_token_id=eos_id)[0, len(ids):].tolist()
        out.append([t for t in gen if t != eos_id] if eos_id is not None else gen)
    return out


@torch.no_grad()
def token_routing(model, sequence: list[int]) -> list[torch.Tensor]:
    """Per MoE layer, [tokens, top_k] expert ids of every token of `sequence` (one causal forward)."""
    with routing_hooks(model) as trace:
        model(input_ids=torch.tensor([sequence]))
    return [ids[0].view(len(sequence), -1) for ids in trace.topk_ids]


def step_distinct(routing: list[list[torch.Tensor]], starts: list[int], lengths: list[int], k: int,
                  concurrency: int) -> list[list[int]]:
    """Distinct experts per layer for every step: sequences in groups of `concurrency`; step s of a group
    carries positions start + s*(k+1) ... + k of each member still running. Returns [step][layer]."""
    steps = []
    for g in range(0, len(routing) - concurrency + 1, concurrency):
        members = range(g, g + concurrency)
        n_steps = max(lengths[i] for i in members) // (k + 1)
        for s in range(n_steps):
            per_layer = []
            for layer in range(len(routing[g])):
                picks = [routing[i][layer][starts[i] + s * (k + 1): starts[i] + (s + 1) * (k + 1)]
                         for i in members if (s + 1) * (k + 1) <= lengths[i]]
                if not picks:
                    break
                per_layer.append(int(torch.unique(torch.cat(picks)).numel()))
            if per_layer:
                steps.append(per_layer)
    return steps


def independent_expectation(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts if every token picked top_k experts uniformly at random, independently."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@dataclass
class SpecResult:
    output: list[int]
    verify_steps: int
    accepted_tokens: int          # draft tokens accepted
    distinct: list[list[int]]     # per verify step, per layer (after the budget)
    seconds: float


def ngram_draft(context: list[int], k: int, max_match: int = 4, min_match: int = 2) -> list[int]:
    """Prompt-lookup drafting: the k tokens that followed the latest earlier occurrence of the longest suffix."""
    for n in range(max_match, min_match - 1, -1):
        if len(context) <= n:
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                follow = context[start + n: start + n + k]
                if follow:
                    return follow
    return []


@torch.no_grad()
def speculative_greedy(model, prompt: list[int], max_new_tokens: int, k: int, budget: int | None,
                       eos_id: int | None) -> SpecResult:
    """Greedy speculative decoding with n-gram drafts; every verification forward carries the last token plus
    up to k drafts, and each MoE layer's routing in it goes through `budget_topk` (None: unbudgeted)."""
    from transformers import DynamicCache

    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]

    def transform(i, logits, weights, ids):
        if budget is None:
            return weights, ids
        return budget_topk(weights, ids, logits, budget, "sigmoid", routers[i].e_score_correction_bias)

    t0 = time.time()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True) \
        if len(prompt) > 1 else None
    del out
    context, generated = list(prompt), []
    steps = accepted = 0
    distinct: list[list[int]] = []
    while len(generated) < max_new_tokens:
        drafts = ngram_draft(context, k)[: max(0, max_new_tokens - len(generated) - 1)]
        tokens = [context[-1], *drafts]
        with routing_hooks(model, transform) as trace:
            logits = model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0]
        steps += 1
        distinct.append([int(torch.unique(ids[0]).numel()) for ids in trace.topk_ids])
        best = logits.argmax(-1).tolist()
        n_ok = 0
        while n_ok < len(drafts) and drafts[n_ok] == best[n_ok]:
            n_ok += 1
        new = drafts[:n_ok] + [best[n_ok]]
        accepted += n_ok
        surplus = cache.get_seq_length() - (len(context) + n_ok)   # keep the verified prefix (bonus not cached yet)
        if surplus > 0:
            cache.crop(-surplus)
        stop = eos_id is not None and eos_id in new
        if stop:
            new = new[: new.index(eos_id)]
        context += new
        generated += new
        if stop:
            break
    return SpecResult(generated[:max_new_tokens], steps, accepted, distinct, time.time() - t0)


def agreement(output: list[int], reference: list[int]) -> float:
    """Share of the reference's tokens reproduced before the first divergence (1.0 = identical)."""
    n = 0
    while n < min(len(output), len(reference)) and output[n] == reference[n]:
        n += 1
    return 1.0 if output == reference else n / max(len(reference), 1)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def teacher_continuations(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """SmolLM2-135M-Instruct's greedy answers (the text the small MoE was distilled from), cached by content."""
    import hashlib
    import json

    from experiments.config.paths import cache_dir
    from experiments.moe.model import load_model, smollm2_dir

    key = hashlib.sha256(json.dumps([prompts, max_new_tokens]).encode()).hexdigest()[:16]
    path = cache_dir() / "moe" / f"teacher-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    teacher = load_model(smollm2_dir())
    out = greedy_continuations(teacher, prompts, max_new_tokens, teacher.generation_config.eos_token_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


@dataclass
class AlongResult:
    verify_steps: int
    accepted_tokens: int            # draft tokens the (budgeted) model's greedy prediction accepted
    positions: int                  # verified positions
    agreeing_positions: int         # budgeted greedy prediction == unbudgeted greedy prediction
    distinct: list[list[int]]       # per verify step, per layer (after the budget)
    seconds: float


@torch.no_grad()
def verify_along(model, prompt: list[int], text: list[int], k: int, budget: int | None) -> AlongResult:
    """Verification steps along a given continuation (teacher forcing): at each step the context is the
    prompt plus the text so far, the drafts are n-gram proposals from it, and one forward verifies the last
    token plus the drafts, with the budget applied to its routing; the step then advances along the text by
    the accepted drafts + 1. Also runs the unbudgeted forward to compare greedy predictions position by position."""
    from transformers import DynamicCache

    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]

    def transform(i, logits, weights, ids):
        return budget_topk(weights, ids, logits, budget, "sigmoid", routers[i].e_score_correction_bias)

    t0 = time.time()
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    full = list(prompt) + list(text)
    pos = len(prompt)                                    # next position to produce
    steps = accepted = positions = agreeing = 0
    distinct: list[list[int]] = []
    while pos < len(full):
        context = full[:pos]
        drafts = ngram_draft(context, k)[: len(full) - pos]
        tokens = torch.tensor([[context[-1], *drafts]])
        base = cache.get_seq_length()
        free_pred = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[0].argmax(-1)
        cache.crop(-(cache.get_seq_length() - base))
        if budget is not None:
            with routing_hooks(model, transform) as trace:
                pred = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[0].argmax(-1)
            cache.crop(-(cache.get_seq_length() - base))
        else:
            with routing_hooks(model) as trace:
                pred = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[0].argmax(-1)
            cache.crop(-(cache.get_seq_length() - base))
        distinct.append([int(torch.unique(ids[0]).numel()) for ids in trace.topk_ids])
        n_ok = 0
        while n_ok < len(drafts) and drafts[n_ok] == int(pred[n_ok]):
            n_ok += 1
        steps += 1
        accepted += n_ok
        positions += len(drafts) + 1
        agreeing += int((pred == free_pred).sum())
        advance = min(n_ok + 1, len(full) - pos)
        model(input_ids=torch.tensor([full[pos - 1: pos - 1 + advance]]), past_key_values=cache, use_cache=True)
        pos += advance
    return AlongResult(steps, accepted, positions, agreeing, distinct, time.time() - t0)
