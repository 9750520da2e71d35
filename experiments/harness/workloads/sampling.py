"""Which conversation is sent when. Engines keep state (SGLang's NGRAM drafter caches everything it served),
so a prompt sent twice measures the cache: warm-ups come from conversations that are never measured, and each
(concurrency level, repetition) gets its own disjoint, category-stratified slice. Everything is seeded and
independent of the input order, so an option and its baseline get identical slices."""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

from experiments.harness.workloads.formats import Conversation, WorkloadError

REUSE_HINT = ("or set workload.reuse_prompts=true (every slice then sends every prompt: on an engine with "
              "cross-request state that measures its cache)")


def by_category(convs: list[Conversation], seed: int) -> dict[str, list[Conversation]]:
    """Category -> its conversations in a seeded order (sorted first: the input order does not matter)."""
    groups: dict[str, list[Conversation]] = defaultdict(list)
    for conv in sorted(convs, key=lambda c: (c.category, c.id)):
        groups[conv.category].append(conv)
    for category, group in groups.items():
        random.Random(f"{seed}/{category}").shuffle(group)
    return dict(sorted(groups.items()))


def quotas(sizes: dict[str, int], n: int) -> dict[str, int]:
    """n split over categories in proportion to their sizes (largest remainder; ties by name)."""
    total = sum(sizes.values())
    exact = {k: n * v / total for k, v in sizes.items()}
    out = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], k))[: n - sum(out.values())]:
        out[k] += 1
    return out


def stratified_sample(convs: list[Conversation], n: int, seed: int) -> list[Conversation]:
    """A seeded sample of n, stratified by category, kept in the input order."""
    if not 0 < n <= len(convs):
        raise WorkloadError(f"num_prompts={n}, but the prompt set has {len(convs)} conversations")
    groups = by_category(convs, seed)
    take = quotas({k: len(v) for k, v in groups.items()}, n)
    chosen = {id(c) for k, group in groups.items() for c in group[: take[k]]}
    return [c for c in convs if id(c) in chosen]


def interleave(groups: dict[str, list[Conversation]]) -> list[Conversation]:
    """Round-robin over categories: any prefix of the result is spread over the categories."""
    out, longest = [], max((len(g) for g in groups.values()), default=0)
    for i in range(longest):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


@dataclass
class VisitPlan:
    warmup: list[Conversation]                       # single-stream, unrecorded
    level_warmup: dict[int, list[Conversation]]      # one unrecorded batch before each level > 1
    measured: dict[tuple[int, int], list[Conversation]]  # (level, repetition) -> its slice
    reuse: bool = False
    levels: list[int] = field(default_factory=list)

    @property
    def repetitions(self) -> int:
        return 1 + max(rep for _, rep in self.measured)

    def describe(self) -> dict[str, int | bool]:
        sizes = [len(s) for s in self.measured.values()]
        distinct = {c.id for s in self.measured.values() for c in s}
        out: dict[str, int | bool] = {"warmup": len(self.warmup), "reuse_prompts": self.reuse,
                                      "slices": len(sizes), "measured_conversations": len(distinct),
                                      "measured_visits": sum(sizes), "slice_min": min(sizes),
                                      "slice_max": max(sizes)}
        out.update({f"level_warmup.c{level}": len(b) for level, b in self.level_warmup.items()})
        return out


def _check_args(convs: list[Conversation], levels: list[int], repetitions: int, warmup: int) -> None:
    if not levels or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in levels):
        raise WorkloadError(f"concurrency levels must be positive integers, got {levels!r}")
    if len(set(levels)) != len(levels):
        raise WorkloadError(f"concurrency levels repeat: {levels!r}")
    if repetitions < 1 or warmup < 0:
        raise WorkloadError(f"repetitions must be >= 1 and warmup_requests >= 0, got {repetitions}, {warmup}")
    if len({c.id for c in convs}) != len(convs):
        raise WorkloadError("conversation ids repeat; a plan needs unique ids")


def _deal(groups: dict[str, list[Conversation]], slots: int) -> list[list[Conversation]]:
    """Near-equal slices (sizes differ by at most 1), each category spread evenly over them."""
    slices: list[list[Conversation]] = [[] for _ in range(slots)]
    for i, conv in enumerate(c for g in groups.values() for c in g):
        slices[i % slots].append(conv)
    return slices


def _too_small(levels: list[int], repetitions: int, warmup: int, have: int, slot: tuple[int, int],
               size: int, reuse: bool) -> WorkloadError:
    level, rep = slot
    if reuse:
        return WorkloadError(f"workload too small: {size} conversation(s) left after {warmup} warm-up(s), fewer "
                             f"than concurrency {level}; need at least {warmup + max(levels)} prompts, have {have}")
    need = warmup + len(levels) * repetitions * max(levels)
    return WorkloadError(
        f"workload too small: the slice for concurrency {level}, repetition {rep} gets {size} conversation(s), "
        f"fewer than its concurrency {level}. Disjoint slices for levels {levels} x {repetitions} repetition(s) "
        f"plus {warmup} warm-up(s) need at least {need} prompts ({warmup} + {len(levels)} x {repetitions} x "
        f"{max(levels)}); the workload has {have}. Use more prompts (workload.num_prompts, a bigger set), fewer "
        f"levels or repetitions, {REUSE_HINT}")


def plan_visits(convs: list[Conversation], levels: list[int], repetitions: int, warmup: int, seed: int,
                reuse: bool = False, num_prompts: int | None = None) -> VisitPlan:
    """Warm-ups carved off first (never measured); of the rest, `num_prompts` (a stratified sample; None: all)
    are split into len(levels) x repetitions disjoint slices, or, with `reuse`, every slice gets all of them."""
    _check_args(convs, levels, repetitions, warmup)
    if warmup >= len(convs):
        raise WorkloadError(f"warmup_requests={warmup} leaves nothing to measure from {len(convs)} prompts; "
                            "warm-ups are never measured: lower warmup_requests or use more prompts")
    order = interleave(by_category(convs, seed))
    pool = order[:warmup]
    warm_ids = {c.id for c in pool}
    rest = [c for c in convs if c.id not in warm_ids]
    if num_prompts is not None:
        if num_prompts > len(rest):
            raise WorkloadError(f"num_prompts={num_prompts} measured prompts, but {len(convs)} prompts less "
                                f"{warmup} warm-up(s) leave {len(rest)}; lower num_prompts or warmup_requests")
        rest = stratified_sample(rest, num_prompts, seed)
    slots = [(level, rep) for level in levels for rep in range(repetitions)]
    if reuse:
        slices = [interleave(by_category(rest, seed)) for _ in slots]
    else:
        slices = [interleave(by_category(s, seed)) for s in _deal(by_category(rest, seed), len(slots))]
    for slot, s in zip(slots, slices, strict=True):
        if len(s) < slot[0] or not s:
            raise _too_small(levels, repetitions, warmup, len(convs), slot, len(s), reuse)
    measured = dict(zip(slots, slices, strict=True))
    return VisitPlan(warmup=pool, level_warmup=_level_warmup(pool, levels), measured=measured, reuse=reuse,
                     levels=list(levels))


def _level_warmup(pool: list[Conversation], levels: list[int]) -> dict[int, list[Conversation]]:
    """A batch of `level` warm-up conversations per level > 1, cycling through the pool."""
    out, cursor = {}, 0
    for level in levels:
        if level > 1 and pool:
            out[level] = [pool[(cursor + i) % len(pool)] for i in range(level)]
            cursor = (cursor + level) % len(pool)
    return out
