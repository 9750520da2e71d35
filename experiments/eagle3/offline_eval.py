"""Offline estimate of a head's acceptance on a serving prompt set (experiments/prompt_sets/*.jsonl): the
target's greedy answers to those prompts (chat template applied, as the workload does), their aux features,
then the training-time-test evaluation — per-step top-1 agreement with the target's greedy token and the
expected accept length of a chain of k drafts. These sets are never used for training, so this is the honest
held-out number (the trainer's own validation split shares its templates with the training prompts).

    python -m experiments.eagle3.offline_eval HEAD_DIR [--model DIR] [--sets chat code math grounded]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from experiments.tracking.records import read_jsonl

PROMPT_SETS = Path(__file__).resolve().parents[1] / "prompt_sets"


def prompt_rows(name: str, tok) -> list[dict]:
    from experiments.eagle3.data import chat_ids

    rows = read_jsonl(PROMPT_SETS / f"{name}.jsonl")
    return [{"id": str(r.get("id", i)), "kind": name, "prompt_ids": chat_ids(tok, r["messages"])}
            for i, r in enumerate(rows)]


def evaluate_sets(head, model_path: str, sets: list[str], max_new_tokens: int, steps: int,
                  device: str = "cpu") -> dict[str, dict]:
    """Load the target in fp32 (the features the head was trained on) and evaluate each prompt set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    # answers from the bf16 target (what the engines serve), features from fp32 (what training used)
    gen = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval().to(device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval().to(device)
    head = head.to(device).eval()
    from experiments.eagle3.data import greedy_answers
    from experiments.eagle3.features import extract
    from experiments.eagle3.train import Batches, Compute, evaluate

    results = {}
    for name in sets:
        rows = prompt_rows(name, tok)
        greedy_answers(gen, tok, rows, max_new_tokens, 64, progress=lambda m: None)
        feats = extract(rows, model, head.config.aux_layer_ids, 8192, progress=lambda m: None)
        teacher_w = model.get_output_embeddings().weight.float()[head.draft_ids]
        with torch.no_grad():
            res = evaluate(Compute(head, False), Batches(feats, list(range(feats.num_sequences)), 4096),
                           teacher_w, steps, bf16=device != "cpu")
        res.update(prompts=len(rows), answer_tokens=sum(len(r["response_ids"]) for r in rows))
        results[name] = res
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.eagle3.offline_eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--sets", nargs="+", default=["chat", "code", "math", "grounded"])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    from experiments.eagle3.export import load_head

    model_path = a.model
    if model_path is None:
        from experiments.config.paths import cache_dir
        model_path = str(cache_dir() / "models" / "SmolLM2-135M-Instruct")
    from transformers import AutoModelForCausalLM

    embed = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).get_input_embeddings().weight
    head = load_head(a.head, embed.detach())
    sets = [s for s in a.sets if (PROMPT_SETS / f"{s}.jsonl").exists()]
    for name, r in evaluate_sets(head, model_path, sets, a.max_new_tokens, a.steps).items():
        print(json.dumps({"set": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
