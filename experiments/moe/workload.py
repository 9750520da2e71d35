"""The prompts the small MoE is measured on: the workspace's own prompt sets (chat, grounded, reasoning),
templated with SmolLM2's tokenizer (the small MoE shares it). `python -m experiments.moe.workload` writes them as
token ids, with SmolLM2's greedy answers, to experiments/moe/prompts.json, which the H200 script reads (no
tokenizer needed there) and the offline telemetry uses too, so both sides see the same inputs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from experiments.moe.model import smollm2_dir

PROMPT_FILE = Path(__file__).with_name("prompts.json")
PROMPT_SETS = ("chat", "grounded", "reasoning")


@dataclass(frozen=True)
class Prompt:
    id: str
    token_ids: list[int]


def token_prompts(prompt_set: str, tokenizer_path: str, limit: int | None = None, fmt: str = "auto",
                  max_turns: int | None = None) -> list[Prompt]:
    """A prompt set through the workload loader, in file order (the first `limit`; None or 0: all), each
    conversation's one request as token ids. Multi-turn rows are refused: later turns need the model's answers."""
    from transformers import AutoTokenizer

    from experiments.harness.workloads.formats import WorkloadError
    from experiments.harness.workloads.loader import load_workload
    from experiments.harness.workloads.render import render_turn

    convs = load_workload(prompt_set, fmt, max_turns=max_turns)
    convs = convs[:limit] if limit else convs
    multi = [c.id for c in convs if c.num_turns > 1]
    if multi:
        raise WorkloadError(f"prompt set {prompt_set!r}: {len(multi)} conversation(s) with more than one turn "
                            f"(first {multi[0]!r}); these prompts are sent as one request: set workload.max_turns=1")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [Prompt(c.id, render_turn(tokenizer, c, 0, [])) for c in convs]


def build_prompts(tokenizer_path: Path | None = None) -> list[dict]:
    out = []
    for name in PROMPT_SETS:
        for p in token_prompts(name, str(tokenizer_path or smollm2_dir())):
            out.append({"id": f"{name}/{p.id}", "set": name, "token_ids": list(p.token_ids)})
    return out


def load() -> list[dict]:
    return json.loads(PROMPT_FILE.read_text())["prompts"]


TEACHER_TOKENS = 96


def main() -> int:
    from experiments.moe.routing import teacher_continuations

    prompts = build_prompts()
    answers = teacher_continuations([p["token_ids"] for p in prompts], TEACHER_TOKENS)
    for p, answer in zip(prompts, answers, strict=True):
        p["teacher_ids"] = answer
    PROMPT_FILE.write_text(json.dumps({"tokenizer": "SmolLM2-135M-Instruct (chat template, generation prompt)",
                                       "teacher_ids": f"SmolLM2-135M-Instruct's greedy answer, {TEACHER_TOKENS} "
                                                      "tokens at most, end-of-turn dropped",
                                       "sets": list(PROMPT_SETS), "prompts": prompts}) + "\n")
    print(f"wrote {len(prompts)} prompts to {PROMPT_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
