"""Is a run's acceptance measuring the drafter, or what the engine remembers from earlier requests?

SGLang's NGRAM drafter caches every output it served: a prompt sent again is drafted from its own earlier
answer, and acceptance rises with each visit (option A on the H200, chat, 8 draft tokens: accept length
1.50 -> 3.60 -> 4.58 over three passes of the same prompts). Two signs of that, from the records alone:

- revisits: prompts sent more than once accept more on later visits than on their first;
- order: among first visits within one concurrency level, acceptance rises with the position of the
  request's start (a cache still filling from other prompts' outputs); a level's repetitions count one
  after another, `order` ranking the starts within each.

Records carry `visit` (1-based: how many times this prompt id was sent to this server, this one included)
and `order` (position of the request's start within its level); records written before those keys existed
get them derived here from the levels' order in the list, then (repetition, start_s). Unrecorded warm-up
requests are invisible then, so a derived first visit may really be a second one: that only shrinks the
revisit effect, so the check stays conservative on old runs.

numpy / scipy only: the harness runs this after measuring and never imports experiments.analysis.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

MIN_PROMPTS = 3        # revisited prompts needed before the revisit rule can fire
MIN_LEVEL = 6          # first visits a level needs to enter the order rule
RISE = 0.10            # relative rise both rules need on top of significance
ORDER_P = 0.01         # one-sided, combined over levels
N_BOOT = 4000
LEVEL = 0.95

Accept = Callable[[dict], float | None]


@dataclass
class ContaminationCheck:
    """flagged when either rule fires (see `check_contamination`); NaN where a number has no data."""
    flagged: bool
    reasons: list[str] = field(default_factory=list)
    requests: int = 0                      # finished requests with an accept length
    first_visits: int = 0
    later_visits: int = 0
    revisited_prompts: int = 0
    first_visit_accept: float = math.nan   # mean over every first visit
    later_visit_accept: float = math.nan   # mean over every later visit
    revisit_diff: float = math.nan         # mean over revisited prompts of (later-visit mean - first visit)
    revisit_diff_low: float = math.nan
    revisit_diff_high: float = math.nan
    revisit_rise: float = math.nan         # revisited prompts: mean later / mean first - 1
    order_n: int = 0                       # first visits in levels entering the order rule
    order_rho: float = math.nan            # Spearman(accept, order), n-weighted mean over those levels
    order_p: float = math.nan              # one-sided (rises), Stouffer-combined over levels
    order_rise: float = math.nan           # last third / first third of each level's first visits - 1

    def as_metrics(self) -> dict[str, float]:
        names = ("requests", "first_visits", "later_visits", "revisited_prompts", "first_visit_accept",
                 "later_visit_accept", "revisit_diff", "revisit_diff_low", "revisit_diff_high", "revisit_rise",
                 "order_n", "order_rho", "order_p", "order_rise")
        out = {"contamination_flagged": float(self.flagged)}
        out.update({f"contamination_{k}": float(getattr(self, k)) for k in names
                    if math.isfinite(float(getattr(self, k)))})
        return out

    def as_tag(self) -> str:
        if self.requests == 0:
            return "unknown: no per-request acceptance"
        if self.flagged:
            return "contaminated: " + "; ".join(self.reasons)
        return (f"clean: {self.revisited_prompts} revisited prompts, {self.order_n} first visits "
                f"in the order test")


def with_visits(records: list[dict]) -> list[dict]:
    """Copies of the records with `visit` and `order` filled in where missing (see the module docstring)."""
    rank = {c: i for i, c in enumerate(dict.fromkeys(r["concurrency"] for r in records))}
    ordered = sorted(records, key=lambda r: (rank[r["concurrency"]], r.get("repetition", 0), r.get("start_s", 0.0)))
    seen: dict[tuple, int] = defaultdict(int)
    position: dict[int, int] = defaultdict(int)
    out = []
    for r in ordered:
        key = (r["prompt_id"], r.get("turn", 0))
        seen[key] += 1
        filled = {**r, "visit": r.get("visit", seen[key]), "order": r.get("order", position[r["concurrency"]])}
        position[r["concurrency"]] += 1
        out.append(filled)
    return out


def _interval_of_mean(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    idx = np.random.default_rng(seed).integers(0, len(values), size=(N_BOOT, len(values)))
    tail = 50.0 * (1.0 - LEVEL)
    lo, hi = np.percentile(values[idx].mean(axis=1), [tail, 100.0 - tail])
    return float(lo), float(hi)


def _revisits(rows: list[tuple[dict, float]], check: ContaminationCheck) -> None:
    first: dict[tuple, float] = {}
    later: dict[tuple, list[float]] = defaultdict(list)
    for r, a in rows:
        key = (r["prompt_id"], r.get("turn", 0))
        if r["visit"] == 1:
            first[key] = a
        else:
            later[key].append(a)
    firsts, laters = list(first.values()), [a for v in later.values() for a in v]
    check.first_visits, check.later_visits = len(firsts), len(laters)
    check.first_visit_accept = float(np.mean(firsts)) if firsts else math.nan
    check.later_visit_accept = float(np.mean(laters)) if laters else math.nan
    both = sorted(first.keys() & later.keys())
    check.revisited_prompts = len(both)
    if len(both) < MIN_PROMPTS:
        return
    a1 = np.array([first[k] for k in both])
    al = np.array([np.mean(later[k]) for k in both])
    diff = al - a1
    check.revisit_diff = float(diff.mean())
    check.revisit_diff_low, check.revisit_diff_high = _interval_of_mean(diff)
    check.revisit_rise = float(al.mean() / a1.mean() - 1.0)
    if check.revisit_diff_low > 0 and check.revisit_rise > RISE:
        check.reasons.append(f"later visits accept {check.revisit_rise:.0%} more than first visits "
                             f"({check.first_visit_accept:.2f} -> {check.later_visit_accept:.2f}; paired "
                             f"difference [{check.revisit_diff_low:.2f}, {check.revisit_diff_high:.2f}] "
                             f"over {len(both)} prompts)")


def _order(rows: list[tuple[dict, float]], check: ContaminationCheck) -> None:
    by_level: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
    for r, a in rows:
        if r["visit"] == 1:
            by_level[r["concurrency"]].append((r.get("repetition", 0), r["order"], a))
    # a level's requests in start order: repetitions one after another, `order` within each
    levels = [np.array(sorted(v))[:, 1:] for v in by_level.values() if len(v) >= MIN_LEVEL]
    if not levels:
        return
    check.order_n = sum(len(lv) for lv in levels)
    varying = [lv for lv in levels if np.ptp(lv[:, 1]) > 0]   # constant acceptance has no rank correlation
    if not varying:
        return
    fits = [stats.spearmanr(np.arange(len(lv)), lv[:, 1], alternative="greater") for lv in varying]
    n = np.array([len(lv) for lv in varying], dtype=float)
    rho = np.array([f.statistic for f in fits], dtype=float)
    p = np.array([f.pvalue for f in fits], dtype=float)
    check.order_rho = float(np.average(rho, weights=n))
    check.order_p = float(p[0] if len(p) == 1 else
                          stats.combine_pvalues(p, method="stouffer", weights=np.sqrt(n)).pvalue)
    thirds = [(lv[: len(lv) // 3, 1], lv[-(len(lv) // 3):, 1]) for lv in levels]
    head, tail = np.concatenate([h for h, _ in thirds]), np.concatenate([t for _, t in thirds])
    check.order_rise = float(tail.mean() / head.mean() - 1.0)
    if check.order_p < ORDER_P and check.order_rise > RISE:
        check.reasons.append(f"first visits accept more the later they start in their level (Spearman "
                             f"{check.order_rho:+.2f}, p = {check.order_p:.1g}, last third "
                             f"{check.order_rise:+.0%} over the first, {check.order_n} requests)")


def check_contamination(records: list[dict], accept: Accept) -> ContaminationCheck:
    """Flags a run whose acceptance depends on what the engine served before. It fires when either holds:

    1. revisits: over the prompts (id, turn) with a first visit and at least one later visit (>= 3 such
       prompts), the 95 % paired-bootstrap interval of mean(later-visit mean - first visit) lies above 0
       AND those prompts' later-visit mean accept length exceeds their first-visit mean by more than 10 %;
    2. order: among first visits, in every concurrency level with >= 6 of them, the one-sided Spearman test
       of accept length rising with `order`; the levels' p-values combined (Stouffer, weights √n) are
       below 0.01 AND the last third of each level's first visits (by order) accepts more than 10 % above
       the first third, pooled over levels.

    `accept(record)` is the request's accept length (emitted tokens / verification steps), None when the
    engine reported none; failed requests are left out.
    """
    rows = [(r, a) for r in with_visits([r for r in records if not r.get("error")])
            if (a := accept(r)) is not None and math.isfinite(a)]
    check = ContaminationCheck(flagged=False, requests=len(rows))
    if rows:
        _revisits(rows, check)
        _order(rows, check)
    check.flagged = bool(check.reasons)
    return check
