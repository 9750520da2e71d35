"""`workload.prompt_set` -> conversations: a built-in set, built-in names joined by commas (a mixed workload),
`sharegpt`, or a path to a .jsonl / .json file."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from experiments.config.paths import PROMPT_SETS
from experiments.harness.workloads.formats import Conversation, WorkloadError, check_format, load_file
from experiments.harness.workloads.sampling import stratified_sample
from experiments.harness.workloads.sharegpt import sample_sharegpt, sharegpt_path

SHAREGPT = "sharegpt"
SUFFIXES = (".jsonl", ".json")


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROMPT_SETS.glob("*.jsonl"))


def _resolve(name: str) -> Path:
    builtin = PROMPT_SETS / f"{name}.jsonl"
    if builtin.is_file() and "/" not in name:
        return builtin
    path = Path(name).expanduser()
    if path.suffix in SUFFIXES:
        if not path.is_file():
            raise WorkloadError(f"prompt file {path} does not exist; set workload.prompt_set to an existing file, "
                                f"a built-in set {builtin_names()} or {SHAREGPT!r}")
        return path
    raise WorkloadError(f"prompt set {name!r} is not a built-in set {builtin_names()}, {SHAREGPT!r}, "
                        f"or a path ending in {' or '.join(SUFFIXES)}")


def _parts(prompt_set: str) -> list[str]:
    parts = [p.strip() for p in str(prompt_set).split(",")]
    if not all(parts):
        raise WorkloadError(f"prompt set {prompt_set!r} has an empty name; join names with single commas")
    if len(set(parts)) != len(parts):
        raise WorkloadError(f"prompt set {prompt_set!r} names a set twice")
    if SHAREGPT in parts and len(parts) > 1:
        raise WorkloadError(f"{SHAREGPT!r} cannot be mixed with other sets in {prompt_set!r}")
    return parts


def prompt_set_files(prompt_set: str) -> list[Path]:
    """The files a prompt set reads (for logging them as run inputs)."""
    parts = _parts(prompt_set)
    return [sharegpt_path()] if parts == [SHAREGPT] else [_resolve(p) for p in parts]


def load_workload(prompt_set: str, fmt: str = "auto", num_prompts: int | None = None, seed: int = 0,
                  max_turns: int | None = None) -> list[Conversation]:
    """The workload's conversations: all of them, or a seeded sample of num_prompts stratified by category.
    In a mixed workload the ids get their set's name (`math/percent`): sets may reuse each other's ids."""
    check_format(fmt, max_turns)
    if num_prompts is not None and (isinstance(num_prompts, bool) or not isinstance(num_prompts, int)
                                    or num_prompts < 1):
        raise WorkloadError(f"num_prompts must be a positive integer or null, got {num_prompts!r}")
    parts = _parts(prompt_set)
    if parts == [SHAREGPT]:
        if fmt not in ("auto", "sharegpt"):
            raise WorkloadError(f"prompt set {SHAREGPT!r} is in format sharegpt, not {fmt!r}")
        return sample_sharegpt(num_prompts, seed, max_turns)
    convs: list[Conversation] = []
    for part in parts:
        loaded = load_file(_resolve(part), fmt, max_turns)
        if len(parts) > 1:
            loaded = [replace(c, id=f"{Path(part).stem}/{c.id}") for c in loaded]
        convs += loaded
    _check_unique(convs)
    return stratified_sample(convs, num_prompts, seed) if num_prompts is not None else convs


def _check_unique(convs: list[Conversation]) -> None:
    seen: dict[str, str] = {}
    for c in convs:
        if c.id in seen:
            raise WorkloadError(f"duplicate id {c.id!r} at {seen[c.id]} and {c.source}; ids must be unique")
        seen[c.id] = c.source


def prompt_set_digest(convs: list[Conversation]) -> str:
    """sha256 over the canonical JSON of what the server is sent (not where it was read from), by id."""
    canonical = json.dumps(sorted((c.content() for c in convs), key=lambda d: d["id"]), sort_keys=True,
                           ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
