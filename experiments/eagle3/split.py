"""The seeded split of ShareGPT V3 into training and held-out conversations, with every measured prompt removed.

Measured prompts: every user turn of the built-in prompt sets (experiments/prompt_sets/*.jsonl), of the
conversations that `workload=sharegpt` draws (its seeded sample for each seed in `sharegpt_seeds`, up to
`sharegpt_size` conversations: the workload's sample of n ≤ sharegpt_size at that seed is a subset of it, since
`random.sample` picks the same first n) and of any exclusion file (any workload format). A conversation is
excluded when any of its user turns matches one (text case-folded, whitespace collapsed, then hashed), or when
it is another part of a drawn ShareGPT conversation (ids `<base>_<part>`). What is left is deduplicated by first
user turn and split by conversation (all parts of one base id on the same side): `val_fraction` held out.
Only the standard library (and the workloads' own file parsers): the H200 trainer runs without Hydra or MLflow.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from experiments.harness.workloads.formats import Conversation, load_file

PROMPT_SETS = Path(__file__).resolve().parents[1] / "prompt_sets"
_WS = re.compile(r"\s+")
_PART = re.compile(r"_\d+$")


def normalise(text: str) -> str:
    """What two prompts must share to count as the same: case-folded, whitespace collapsed, trimmed."""
    return _WS.sub(" ", text.casefold()).strip()


def turn_hash(text: str) -> str:
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()[:32]


def user_texts(conv: Conversation) -> list[str]:
    """Every user-authored text of a conversation: its live turns, user messages of its history, a raw prompt."""
    texts = [m["content"] for m in conv.prefix if m.get("role") == "user"] + list(conv.user_turns)
    return texts + ([conv.raw_prompt] if conv.raw_prompt is not None else [])


def base_id(conv_id: str) -> str:
    """ShareGPT cuts long conversations into parts `<base>_0`, `<base>_1`, ...: one conversation, one base."""
    return _PART.sub("", conv_id)


@dataclass(frozen=True)
class SplitSettings:
    seed: int = 0
    val_fraction: float = 0.02
    num_conversations: int | None = None       # training conversations kept (seeded sample); None: all
    sharegpt_seeds: tuple[int, ...] = (0, 1, 2)
    sharegpt_size: int = 512
    exclude_files: tuple[str, ...] = ()

    def ident(self) -> dict:
        return {**asdict(self), "sharegpt_seeds": list(self.sharegpt_seeds), "exclude_files": [
            f"{Path(p).name}:{hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16]}" for p in self.exclude_files]}


@dataclass
class Split:
    train: list[Conversation]
    val: list[Conversation]
    excluded: list[tuple[Conversation, str]]          # (conversation, why)
    manifest: dict = field(default_factory=dict)


def measured_turns(s: SplitSettings) -> tuple[dict[str, str], set[str]]:
    """{turn hash: where it is measured}, and the base ids of the ShareGPT conversations the workload draws."""
    from experiments.harness.workloads.sharegpt import sample_sharegpt

    found: dict[str, str] = {}
    sources = [(f"prompt_sets/{p.stem}", load_file(p)) for p in sorted(PROMPT_SETS.glob("*.jsonl"))]
    sources += [(f"file:{Path(p).name}", load_file(Path(p))) for p in s.exclude_files]
    drawn = [c for seed in s.sharegpt_seeds for c in sample_sharegpt(s.sharegpt_size, seed, None)]
    sources.append(("workload=sharegpt", drawn))
    for label, convs in sources:
        for conv in convs:
            for text in user_texts(conv):
                found.setdefault(turn_hash(text), label)
    return found, {base_id(c.id) for c in drawn}


def _why_excluded(conv: Conversation, measured: dict[str, str], drawn_bases: set[str]) -> str | None:
    if base_id(conv.id) in drawn_bases:
        return "workload=sharegpt"
    return next((measured[h] for h in map(turn_hash, user_texts(conv)) if h in measured), None)


def _is_val(conv: Conversation, s: SplitSettings) -> bool:
    digest = hashlib.sha256(f"{s.seed}/{base_id(conv.id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < s.val_fraction


def build_split(s: SplitSettings, conversations: list[Conversation] | None = None) -> Split:
    """The split of `conversations` (default: every valid ShareGPT V3 conversation) under `s`."""
    from experiments.harness.workloads.sharegpt import sample_sharegpt

    convs = list(conversations) if conversations is not None else sample_sharegpt(None, 0, None)
    measured, drawn_bases = measured_turns(s)
    train, val, excluded, seen = [], [], [], set()
    for conv in convs:
        why = _why_excluded(conv, measured, drawn_bases)
        first = turn_hash(conv.user_turns[0]) if conv.user_turns else turn_hash(conv.raw_prompt or "")
        if why is None and first in seen:
            why = "duplicate"
        if why is not None:
            excluded.append((conv, why))
            continue
        seen.add(first)
        (val if _is_val(conv, s) else train).append(conv)
    if s.num_conversations is not None and s.num_conversations < len(train):
        keep = set(random.Random(f"split/{s.seed}").sample(range(len(train)), s.num_conversations))
        train = [c for i, c in enumerate(train) if i in keep]
        val = val[: max(1, round(len(train) * s.val_fraction / (1 - s.val_fraction)))] if val else val
    return Split(train, val, excluded, manifest(s, convs, train, val, excluded, measured))


def manifest(s: SplitSettings, convs: list[Conversation], train: list[Conversation], val: list[Conversation],
             excluded: list[tuple[Conversation, str]], measured: dict[str, str]) -> dict:
    """Counts, settings and digests: what the CPU option-D run and the H200 trainer both write."""
    reasons: dict[str, int] = {}
    for _, why in excluded:
        reasons[why] = reasons.get(why, 0) + 1

    def ids_digest(cs: list[Conversation]) -> str:
        return hashlib.sha256("\n".join(sorted(c.id for c in cs)).encode()).hexdigest()

    return {"settings": s.ident(), "conversations": len(convs), "train": len(train), "val": len(val),
            "train_user_turns": sum(len(c.user_turns) for c in train),
            "excluded": len(excluded), "excluded_by_reason": dict(sorted(reasons.items())),
            "measured_turns": len(measured),
            "measured_turns_sha256": hashlib.sha256("\n".join(sorted(measured)).encode()).hexdigest(),
            "excluded_ids_sha256": ids_digest([c for c, _ in excluded]),
            "train_ids_sha256": ids_digest(train), "val_ids_sha256": ids_digest(val)}


def write_manifest(split: Split, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(split.manifest, indent=2, sort_keys=True) + "\n")
    return path
