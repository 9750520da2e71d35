"""Acceptance predicted offline, before the option runs, from a finished baseline's records: what each request
would emit per decode step under the option's drafter, given the baseline's own greedy outputs.

- n-gram: the replay of the drafter over the baseline's prompt + output ids (experiments/analysis/ngram_replay.py;
  exact for vLLM's prompt lookup, a stated lower bound for SGLang's trie: `NgramWindow.exact`).
- EAGLE-3: the head's expected accept length on the baseline's outputs (the training-time-test evaluation of
  experiments/eagle3/train.py over the target's own features), per request. Needs the target's weights and the
  head on this machine.

Each returns one `RequestSteps` per finished baseline record, in record order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.analysis.ngram_replay import NgramConfig, NgramIndex, ReplaySequence, replay_config
from experiments.analysis.runs import RunConfig


class AcceptanceUnavailable(ValueError):
    """The offline acceptance cannot be computed; the message names the missing input."""


@dataclass(frozen=True)
class RequestSteps:
    """One baseline request under the option: decode tokens it must emit, steps it would take, share drafted."""
    decode_tokens: int
    steps: float
    drafted_share: float    # of those steps, the share that carries a draft (vLLM n-gram; 1 for fixed-width engines)


def finished(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("error") and r.get("output_token_ids") and r.get("e2e_s")]


def ngram_steps(records: list[dict], config: RunConfig, max_model_len: int = 2048) -> tuple[list[RequestSteps], str]:
    """Replayed steps per request for the option's n-gram window, and a note on its exactness."""
    window = config.ngram_window()
    if window is None:
        raise AcceptanceUnavailable("the option drafts no n-grams")
    rows = finished(records)
    if any(not isinstance(r.get("prompt_token_ids"), list) for r in rows):
        raise AcceptanceUnavailable("the baseline's records carry no prompt token ids")
    tail = window.prompt_tail
    seqs = [ReplaySequence([int(t) for t in r["prompt_token_ids"]][-tail if tail else 0:],
                           [int(t) for t in r["output_token_ids"]]) for r in rows]
    cfg = NgramConfig(window.min_match, window.max_match, window.k)
    stats = replay_config(NgramIndex(seqs, cfg.max_match), cfg, max_model_len)
    out = [RequestSteps(s.decode_tokens, float(max(s.steps, 1)),
                        1.0 if config.fixed_verify_width else (s.drafts / s.steps if s.steps else 0.0))
           for s in stats]
    seen = f"the prompt's last {tail} tokens" if tail else "the whole prompt"
    note = (f"acceptance: n-gram replay of the baseline's outputs ({cfg.label}, {seen} and the output; "
            f"{'exact' if window.exact else 'a lower bound: one prompt-lookup chain per request'})")
    return out, note


def eagle_steps(records: list[dict], model_path: str | None, head_path: str | None,
                num_steps: int) -> tuple[list[RequestSteps], str]:
    """Steps per request from the head's expected accept length over the baseline's outputs (CPU, fp32)."""
    for what, path in (("the target model", model_path), ("the EAGLE-3 head", head_path)):
        if not path or not (Path(path) / "config.json").exists():
            raise AcceptanceUnavailable(f"{what} is not on this machine ({path})")
    rows = finished(records)
    taus = head_accept_lengths(rows, str(model_path), str(head_path), num_steps)
    out = [RequestSteps(max(0, len(r["output_token_ids"]) - 1), max(1.0, (len(r["output_token_ids"]) - 1) / t), 1.0)
           for r, t in zip(rows, taus, strict=True)]
    return out, f"acceptance: the head's offline accept length over the baseline's outputs ({num_steps} steps)"


def head_accept_lengths(rows: list[dict], model_path: str, head_path: str, num_steps: int) -> list[float]:
    """Expected tokens per step of a chain of `num_steps` drafts, per request (1 + Σ P(drafts 0..k right))."""
    import torch
    from transformers import AutoModelForCausalLM

    from experiments.eagle3.batches import Batches
    from experiments.eagle3.export import load_head
    from experiments.eagle3.features import extract
    from experiments.eagle3.train import Compute, evaluate

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    head = load_head(Path(head_path), model.get_input_embeddings().weight.detach()).eval()
    seqs = [{"id": str(i), "kind": str(r.get("category") or ""), "prompt_ids": [int(t) for t in r["prompt_token_ids"]],
             "response_ids": [int(t) for t in r["output_token_ids"]]} for i, r in enumerate(rows)]
    feats = extract(seqs, model, head.config.aux_layer_ids, 8192, progress=lambda m: None)
    teacher_w = model.get_output_embeddings().weight.float()[head.draft_ids]
    out = []
    with torch.no_grad():
        for i in range(feats.num_sequences):
            res = evaluate(Compute(head, False), Batches(feats, [i], 4096), teacher_w, num_steps, bf16=False)
            out.append(float(res["accept_length_est"]))
    return out


def offline_steps(records: list[dict], config: RunConfig, params: dict[str, str]) -> tuple[list[RequestSteps], str]:
    """The option's steps per baseline request, from the drafter it names."""
    method = config.spec.method
    if method == "ngram":
        return ngram_steps(records, config, config.max_model_len or 2048)
    if method == "eagle3":
        if not config.spec.num_steps:
            raise AcceptanceUnavailable("spec.num_steps not set")
        return eagle_steps(records, params.get("model.path"), config.spec.draft_model, int(config.spec.num_steps))
    raise AcceptanceUnavailable(f"no offline acceptance for spec.method={method}")
