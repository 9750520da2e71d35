"""The decision per load: which measured configuration to deploy, or none.

A candidate is one configuration (option and its draft setting) measured at one load against its paired baseline.
It is out when it breaks a latency target the baseline meets (experiments/analysis/slo.py). Among the others the
one with the highest lower end of its paired speedup interval is the best; it is the choice when that lower end is
above 1 and a paired comparison on the prompts both served separates it from every other candidate (the interval
of its speedup over the other's lies above 1). Where nothing pays, "no speculation" is the choice, decided when
every candidate's interval lies below 1. Otherwise the row is inconclusive, naming what it could not separate and
about how many further prompts would (stats.prompts_to_decide: the half-width shrinking as 1/√n)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from experiments.analysis.runs import RunConfig
from experiments.analysis.stats import Interval, paired_speedup, prompts_to_decide
from experiments.analysis.words import option_words

NO_SPECULATION = "no speculation"
DECIDED, INCONCLUSIVE = "decided", "inconclusive"


def choice_label(config: RunConfig) -> str:
    """A configuration's key as it is deployed: its option and draft setting ("A k=4", "B steps=3"); what a reader
    sees is its words (Candidate.words, experiments.analysis.words)."""
    spec = config.spec
    detail = {"ngram": f"k={spec.num_draft_tokens}",
              "eagle3": f"steps={spec.num_steps}" + (f" topk={spec.topk}" if (spec.topk or 1) != 1 else "")}
    return f"{config.option} {detail.get(spec.method, spec.method)}"


@dataclass(frozen=True, order=True)
class Load:
    """Closed loop at `concurrency`, or open-loop arrivals (`arrival` at `rate` req/s) capped at `concurrency`."""
    arrival: str
    rate: float | None
    concurrency: int

    @property
    def closed(self) -> bool:
        return self.arrival == "closed"

    @property
    def label(self) -> str:
        if self.closed:
            return f"c {self.concurrency}"
        return f"{self.arrival} {self.rate:g} req/s, cap {self.concurrency}"


@dataclass
class Candidate:
    label: str                                  # "A k=4": the choice as deployed
    config: str                                 # the report's configuration label
    option: str
    engine: str                                 # where it was measured
    spec: dict[str, Any]                        # the run's spec.* settings (the flags are built from them)
    speedup: Interval                           # over the baseline, paired over prompts
    totals: dict[str, tuple[float, float]]      # prompt id -> (tokens, e2e s): pairs candidates with each other
    slo: dict[str, Any] | None = None           # experiments.analysis.slo.level_slo, with targets set
    runs: list[str] = field(default_factory=list)

    @property
    def breaks(self) -> list[str]:
        return list(self.slo["breaks"]) if self.slo else []

    @property
    def words(self) -> str:
        """The configuration in words ("A: n-gram, 4 draft tokens")."""
        return option_words(self.option, self.spec, self.engine)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "words": self.words, "config": self.config, "option": self.option,
                "engine": self.engine,
                "speedup": self.speedup.as_dict(), "breaks_slo": self.breaks, "runs": self.runs,
                "goodput_ratio": (self.slo or {}).get("goodput_ratio"), "slo": self.slo}


@dataclass
class Decision:
    load: Load
    choice: str                        # a candidate's label or NO_SPECULATION
    status: str                        # DECIDED | INCONCLUSIVE
    reason: str
    speedup: Interval | None = None    # the choice's over the baseline (None: no speculation)
    versus: list[str] = field(default_factory=list)    # what the choice could not be separated from
    further_prompts: int | None = None                 # about how many more prompts would decide it
    candidates: list[Candidate] = field(default_factory=list)

    def words(self, label: str) -> str:
        """A candidate's label (or NO_SPECULATION) in words."""
        return next((c.words for c in self.candidates if c.label == label), label)

    def as_dict(self) -> dict[str, Any]:
        return {"load": self.load.label, "arrival": self.load.arrival, "rate": self.load.rate,
                "concurrency": self.load.concurrency, "choice": self.choice, "choice_words": self.words(self.choice),
                "versus_words": [self.words(v) for v in self.versus], "status": self.status, "reason": self.reason,
                "speedup": self.speedup.as_dict() if self.speedup else None,
                "versus": self.versus, "further_prompts": self.further_prompts,
                "candidates": [c.as_dict() for c in self.candidates]}


def _further(iv: Interval) -> int | None:
    """Prompts beyond those measured that would make `iv` exclude 1 if its estimate held; None: unknown."""
    total = prompts_to_decide(iv)
    return None if total is None else total - iv.n


def _versus(best: Candidate, other: Candidate) -> tuple[bool, int | None]:
    """Whether `best` is separated from `other` (paired on the prompts both served; runs on different prompts: by
    their intervals over the baseline not overlapping), and the further prompts that would separate them."""
    iv = paired_speedup(best.totals, other.totals)
    if iv.n == 0:
        return best.speedup.low > other.speedup.high, None
    return iv.low > 1.0, None if iv.low > 1.0 else _further(iv)


def _most(values: list[int | None]) -> int | None:
    return None if not values or any(v is None for v in values) else max(values)


def _paying(load: Load, best: Candidate, rivals: list[Candidate], cands: list[Candidate]) -> Decision:
    apart = {o.label: _versus(best, o) for o in rivals}
    close = [label for label, (separated, _) in apart.items() if not separated]
    iv = best.speedup
    if not close:
        why = f"pays: {iv.estimate:.2f}x [{iv.low:.2f}, {iv.high:.2f}]"
        return Decision(load, best.label, DECIDED, why + (", above every other candidate" if rivals else ""),
                        iv, candidates=cands)
    named = {c.label: c.words for c in cands}
    return Decision(load, best.label, INCONCLUSIVE,
                    f"pays ({iv.estimate:.2f}x [{iv.low:.2f}, {iv.high:.2f}]) but is not separated from "
                    + "; ".join(named[c] for c in close), iv, close, _most([apart[c][1] for c in close]), cands)


def _not_paying(load: Load, eligible: list[Candidate], cands: list[Candidate]) -> Decision:
    open_ = [c for c in eligible if c.speedup.high >= 1.0 or not math.isfinite(c.speedup.high)]
    if not open_:
        return Decision(load, NO_SPECULATION, DECIDED, "every candidate's interval lies below 1", candidates=cands)
    top = max(open_, key=lambda c: c.speedup.estimate)
    iv = top.speedup
    return Decision(load, NO_SPECULATION, INCONCLUSIVE,
                    f"nothing shown to pay; {top.words} ({iv.estimate:.2f}x [{iv.low:.2f}, {iv.high:.2f}]) straddles 1",
                    None, [c.label for c in open_], _most([_further(c.speedup) for c in open_]), cands)


def decide(load: Load, candidates: list[Candidate]) -> Decision:
    """The choice at `load` among `candidates` (see the module's docstring)."""
    eligible = [c for c in candidates if not c.breaks]
    if not eligible:
        broken = "; ".join(f"{c.words} ({', '.join(c.breaks)})" for c in candidates) or "no candidate measured"
        return Decision(load, NO_SPECULATION, DECIDED, f"every option breaks a target the baseline meets: {broken}",
                        candidates=candidates)
    best = max(eligible, key=lambda c: (c.speedup.low, c.speedup.estimate))
    if best.speedup.low > 1.0:
        return _paying(load, best, [c for c in eligible if c is not best], candidates)
    return _not_paying(load, eligible, candidates)


@dataclass(frozen=True)
class Range:
    """Contiguous closed-loop levels with the same choice and status (an open-loop load is a range of its own)."""
    decisions: tuple[Decision, ...]

    @property
    def text(self) -> str:
        """The range in words: "A: n-gram, 4 draft tokens at c = 1–4", "inconclusive at c = 4 (no speculation vs
        C: EAGLE-3, 3 steps; ~6 more prompts)"."""
        first, last = self.decisions[0].load, self.decisions[-1].load
        where = (f"at c = {first.concurrency}" if first == last else f"at c = {first.concurrency}–{last.concurrency}"
                 ) if first.closed else f"under {first.label}"
        d = self.decisions[0]
        if d.status == DECIDED:
            return f"{d.words(d.choice)} {where}"
        further = max((x.further_prompts for x in self.decisions if x.further_prompts is not None), default=None)
        more = f"; ~{further} more prompts" if further is not None else "; more prompts"
        return f"inconclusive {where} ({d.words(d.choice)} vs {'; '.join(map(d.words, d.versus))}{more})"

    def as_dict(self) -> dict[str, Any]:
        d = self.decisions[0]
        return {"text": self.text, "choice": d.choice, "status": d.status,
                "loads": [x.load.label for x in self.decisions]}


def collapse(decisions: list[Decision]) -> list[Range]:
    """Levels in load order; neighbouring closed-loop levels with the same choice and status form one range."""
    out: list[list[Decision]] = []
    for d in sorted(decisions, key=lambda d: d.load):
        prev = out[-1][-1] if out else None
        if prev is not None and d.load.closed and prev.load.closed and (d.choice, d.status, d.versus) == (
                prev.choice, prev.status, prev.versus):
            out[-1].append(d)
        else:
            out.append([d])
    return [Range(tuple(ds)) for ds in out]
