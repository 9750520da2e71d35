"""Prompt sets: JSONL rows with `id` and `messages` (chat, templated with the model's tokenizer) or
`prompt` (raw text). Turned into token ids client-side so every engine sees identical inputs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.config.paths import PROMPT_SETS
from experiments.tracking.records import read_jsonl


@dataclass
class Prompt:
    id: str
    token_ids: list[int]


class WorkloadError(ValueError):
    """A prompt set that cannot be used."""


def prompt_set_path(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.suffix == ".jsonl" and path.exists():
        return path
    builtin = PROMPT_SETS / f"{name_or_path}.jsonl"
    if builtin.exists():
        return builtin
    known = sorted(p.stem for p in PROMPT_SETS.glob("*.jsonl"))
    raise WorkloadError(f"prompt set {name_or_path!r} is neither a .jsonl file nor one of {known}")


def load_prompts(name_or_path: str, tokenizer_path: str, limit: int | None = None) -> list[Prompt]:
    from transformers import AutoTokenizer

    path = prompt_set_path(name_or_path)
    rows = read_jsonl(path)
    if limit:
        rows = rows[:limit]
    if not rows:
        raise WorkloadError(f"prompt set {path} is empty")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    prompts = []
    for n, row in enumerate(rows):
        if "messages" in row:
            ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        elif "prompt" in row:
            ids = tokenizer(row["prompt"])["input_ids"]
        else:
            raise WorkloadError(f"{path} line {n + 1}: needs 'messages' or 'prompt'")
        prompts.append(Prompt(id=str(row.get("id", n)), token_ids=[int(i) for i in ids]))
    return prompts
