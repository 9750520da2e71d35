"""User prompts written by the target itself (the "Magpie" recipe): feed the chat template up to the start of a
user turn and sample; an aligned chat model writes the kind of request it was tuned on. It widens the training
distribution beyond data.py's templates (a head trained only on templates reached 0.70 step-0 accuracy on them
and 0.53 on hand-written chat) without downloading a dataset.

Kept: turns that end with the end-of-turn token within `max_tokens`, of at least `min_words` words, distinct,
and not a serving prompt (those sets measure the head). Sampling is seeded (torch.manual_seed per batch), so a
corpus is reproducible on the same device and library versions.
"""
from __future__ import annotations

import time
from collections.abc import Callable

SPLIT = "\x00SPECWS_USER_TURN\x00"


def user_turn_prefix(tok) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (the model's default system prompt
    included, as the template writes it)."""
    text = tok.apply_chat_template([{"role": "user", "content": SPLIT}], tokenize=False)
    if SPLIT not in text:
        raise ValueError("the chat template does not render the user message verbatim: cannot find the user turn")
    return tok(text.split(SPLIT)[0], add_special_tokens=False).input_ids


def synthesize_prompts(model, tok, n: int, seed: int, exclude: set[str], batch_size: int = 256,
                       max_tokens: int = 64, min_words: int = 4, temperature: float = 1.0, top_p: float = 0.98,
                       progress: Callable[[str], None] = print) -> list[str]:
    """`n` distinct user prompts sampled from the model (on the model's device)."""
    import torch

    if n <= 0:
        return []
    eos = model.generation_config.eos_token_id
    eos_ids = sorted(set(eos if isinstance(eos, list) else [eos]))
    prefix = torch.tensor([user_turn_prefix(tok)], device=model.device)
    kept: list[str] = []
    seen = set(exclude)
    t0, drawn = time.time(), 0
    for b in range(20 * (n // batch_size + 1)):
        torch.manual_seed(seed * 1_000_003 + b)
        with torch.inference_mode():
            gen = model.generate(input_ids=prefix.repeat(batch_size, 1), attention_mask=torch.ones_like(
                prefix).repeat(batch_size, 1), do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                max_new_tokens=max_tokens, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
        drawn += batch_size
        for row in gen[:, prefix.shape[1]:].tolist():
            end = next((i for i, t in enumerate(row) if t in eos_ids), None)
            if end is None:
                continue                                  # ran past max_tokens: not a finished request
            text = tok.decode(row[:end], skip_special_tokens=True).strip()
            if len(text.split()) >= min_words and text not in seen:
                seen.add(text)
                kept.append(text)
        progress(f"eagle3 synthetic prompts: {min(len(kept), n)}/{n} kept of {drawn} sampled, "
                 f"{time.time() - t0:.0f}s")
        if len(kept) >= n:
            return kept[:n]
    raise RuntimeError(f"only {len(kept)} usable prompts of {drawn} sampled (wanted {n}): "
                       "the model rarely ends a user turn; lower the number or raise max_tokens")
