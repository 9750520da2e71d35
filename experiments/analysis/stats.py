"""Intervals and verdicts for speedups measured over prompts.

The unit of resampling is the prompt: option and baseline served the same prompts, so a bootstrap that
draws the same prompts for both (paired) removes the prompt-to-prompt spread (long vs short answers, easy vs
hard continuations) that an unpaired bootstrap over requests would charge to the speedup.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

PAYS, LOSES, UNCLEAR = "pays", "does not pay", "inconclusive"
# blocks of one level (paired in time, or slices measured in turn) decided opposite ways: the verdict depends on
# when, and so on which host state, it was measured
HOST_SENSITIVE = "host-sensitive"


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int           # prompts (or requests) the interval rests on
    method: str

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n, "method": self.method}


def _boot_index(n: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, n) indices: each row one resample with replacement; the same matrix pairs both arms."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def _percentiles(boots: np.ndarray, level: float) -> tuple[float, float]:
    tail = 50.0 * (1.0 - level)
    lo, hi = np.nanpercentile(boots, [tail, 100.0 - tail])
    return float(lo), float(hi)


def paired_speedup(option: dict[str, tuple[float, float]], baseline: dict[str, tuple[float, float]],
                   n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> Interval:
    """Speedup = (Σtok_opt / Σs_opt) / (Σtok_base / Σs_base) over the prompts both runs served, with a
    percentile interval from resampling those prompts (the same draw for both arms).

    Each dict maps a prompt key -> (output tokens, seconds); seconds is the request's end-to-end time
    (summed over a prompt's requests when it was sent more than once). At c = 1 the ratio is exactly the
    output tok/s ratio. At c > 1 the client keeps c requests in flight, so by Little's law the level's wall
    time is Σe2e / c for either arm and the level throughput is c · Σtok / Σe2e: the c cancels in the ratio,
    and each request's e2e carries the cost of sharing a batch with its neighbours, which is exactly what
    speculation changes. Unlike the level's wall time, Σe2e decomposes over prompts, so it can be resampled.
    (It leaves out the drain at the end of a level, when fewer than c requests remain: a small bias that is
    the same kind in both arms.)
    """
    keys = sorted(option.keys() & baseline.keys())
    if not keys:
        return Interval(math.nan, math.nan, math.nan, 0, "none (no common prompts)")
    o = np.array([option[k] for k in keys], dtype=float)
    b = np.array([baseline[k] for k in keys], dtype=float)
    estimate = float((o[:, 0].sum() / o[:, 1].sum()) / (b[:, 0].sum() / b[:, 1].sum()))
    idx = _boot_index(len(keys), n_boot, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = (o[idx, 0].sum(1) / o[idx, 1].sum(1)) / (b[idx, 0].sum(1) / b[idx, 1].sum(1))
    lo, hi = _percentiles(boots, level)
    return Interval(estimate, lo, hi, len(keys), f"paired bootstrap over {len(keys)} prompts")


def blocked_speedup(option: dict[str, tuple[float, float]], baseline: dict[str, tuple[float, float]],
                    blocks: dict[str, int], n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> Interval:
    """The paired speedup with an interval that covers what varies between blocks as well as prompts: each
    resample draws blocks with replacement, then prompts with replacement within each drawn block (a two-stage
    bootstrap), the same draw for both arms. `blocks` maps a prompt key to its block; with fewer than two blocks
    this is paired_speedup."""
    keys = sorted(option.keys() & baseline.keys())
    members: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        members[blocks.get(k, 0)].append(i)
    if len(members) < 2:
        return paired_speedup(option, baseline, n_boot, seed, level)
    o = np.array([option[k] for k in keys], dtype=float)
    b = np.array([baseline[k] for k in keys], dtype=float)
    rng = np.random.default_rng(seed)
    sums = np.zeros((4, len(members), n_boot))   # option tokens, option s, baseline tokens, baseline s per block
    for g, idx in enumerate(members.values()):
        draw = np.asarray(idx)[rng.integers(0, len(idx), size=(n_boot, len(idx)))]
        sums[:, g] = [o[draw, 0].sum(1), o[draw, 1].sum(1), b[draw, 0].sum(1), b[draw, 1].sum(1)]
    chosen = rng.integers(0, len(members), size=(n_boot, len(members)))
    tot = sums[:, chosen.T, np.arange(n_boot)].sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = (tot[0] / tot[1]) / (tot[2] / tot[3])
    estimate = float((o[:, 0].sum() / o[:, 1].sum()) / (b[:, 0].sum() / b[:, 1].sum()))
    lo, hi = _percentiles(boots, level)
    return Interval(estimate, lo, hi, len(keys), f"paired bootstrap over {len(members)} blocks, then {len(keys)} "
                                                 "prompts within them")


def records_speedup(option_records: list[dict], baseline_records: list[dict], n_boot: int = 4000,
                    seed: int = 0) -> Interval:
    """A level's speedup from both runs' records: over blocks, then prompts, where the level has several blocks."""
    return blocked_speedup(prompt_totals(option_records), prompt_totals(baseline_records),
                           prompt_blocks(option_records), n_boot, seed)


def block_speedups(option: dict[str, tuple[float, float]], baseline: dict[str, tuple[float, float]],
                   blocks: dict[str, int], n_boot: int = 2000, seed: int = 0) -> dict[int, Interval]:
    """Each block's own paired speedup over its prompts."""
    out: dict[int, Interval] = {}
    for g in sorted(set(blocks.values())):
        keys = {k for k, blk in blocks.items() if blk == g}
        out[g] = paired_speedup({k: v for k, v in option.items() if k in keys},
                                {k: v for k, v in baseline.items() if k in keys}, n_boot, seed)
    return {g: iv for g, iv in out.items() if iv.n}


def verdict_over_blocks(overall: Interval, per_block: dict[int, Interval]) -> str:
    """host-sensitive where one block decided `pays` and another `does not pay`; else the verdict of the interval
    that covers blocks and prompts."""
    decided = {verdict(iv) for iv in per_block.values()}
    if PAYS in decided and LOSES in decided:
        return HOST_SENSITIVE
    return verdict(overall)


def _padded(groups: list[list[float]]) -> np.ndarray:
    """(prompts, most values of one prompt), NaN where a prompt has fewer: rows resample as clusters."""
    out = np.full((len(groups), max(len(g) for g in groups)), np.nan)
    for i, g in enumerate(groups):
        out[i, : len(g)] = g
    return out


def paired_percentile_ratio(option: dict[str, list[float]], baseline: dict[str, list[float]], q: float = 99.0,
                            n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> Interval:
    """The q-th percentile of the option's values over the baseline's (e.g. TTFT p99), over the prompts both
    served (a prompt's values, its turns or repeated sends, travel together), with a percentile interval from
    resampling those prompts (the same draw for both arms)."""
    keys = sorted(k for k in option.keys() & baseline.keys() if option[k] and baseline[k])
    if not keys:
        return Interval(math.nan, math.nan, math.nan, 0, "none (no common prompts)")
    o, b = _padded([option[k] for k in keys]), _padded([baseline[k] for k in keys])
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = float(np.nanpercentile(o, q) / np.nanpercentile(b, q))
        idx = _boot_index(len(keys), n_boot, seed)
        boots = (np.nanpercentile(o[idx].reshape(n_boot, -1), q, axis=1)
                 / np.nanpercentile(b[idx].reshape(n_boot, -1), q, axis=1))
    lo, hi = _percentiles(boots, level)
    return Interval(estimate, lo, hi, len(keys), f"paired bootstrap over {len(keys)} prompts")


def ratio_interval(numerator: Iterable[float], denominator: Iterable[float], n_boot: int = 4000, seed: int = 0,
                   level: float = 0.95) -> Interval:
    """Σnum / Σden with a bootstrap over the items: e.g. accept length weighted by steps (emitted / steps)."""
    num, den = np.asarray(list(numerator), dtype=float), np.asarray(list(denominator), dtype=float)
    if not len(num) or den.sum() <= 0:
        return Interval(math.nan, math.nan, math.nan, len(num), "none (no data)")
    idx = _boot_index(len(num), n_boot, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = num[idx].sum(1) / den[idx].sum(1)
    lo, hi = _percentiles(boots, level)
    return Interval(float(num.sum() / den.sum()), lo, hi, len(num), f"bootstrap over {len(num)} requests")


def mean_interval(values: Iterable[float], n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> Interval:
    """The plain mean (e.g. accept length per request) with a bootstrap percentile interval."""
    v = np.asarray(list(values), dtype=float)
    return ratio_interval(v, np.ones_like(v), n_boot, seed, level)


def verdict(iv: Interval) -> str:
    """pays: the whole interval above 1; does not pay: the whole interval below 1; else inconclusive."""
    if iv.low > 1.0:
        return PAYS
    if iv.high < 1.0:
        return LOSES
    return UNCLEAR


def prompts_to_decide(iv: Interval) -> int | None:
    """About how many prompts would make the interval exclude 1 if the estimate held, taking the interval's
    half-width on the side facing 1 to shrink as 1/√n. None: already decided, no estimate, or exactly 1."""
    if verdict(iv) != UNCLEAR or iv.n <= 0 or not math.isfinite(iv.estimate) or iv.estimate == 1.0:
        return None
    half = iv.estimate - iv.low if iv.estimate > 1.0 else iv.high - iv.estimate
    if not math.isfinite(half) or half <= 0:
        return None
    return max(iv.n + 1, math.ceil(iv.n * (half / abs(iv.estimate - 1.0)) ** 2))


def prompt_blocks(records: Iterable[dict]) -> dict[str, int]:
    """prompt id -> its block (the slice of its level it was measured in: the records' `repetition`)."""
    return {r["prompt_id"]: int(r.get("repetition", 0)) for r in records}


def prompt_totals(records: Iterable[dict]) -> dict[str, tuple[float, float]]:
    """prompt id -> (output tokens, e2e seconds) summed over its finished requests: a prompt sent several
    times, or a conversation's turns, are resampled as one cluster (they are not independent)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        if r.get("error") or not r.get("e2e_s"):
            continue
        key = r["prompt_id"]
        out[key][0] += len(r["output_token_ids"])
        out[key][1] += r["e2e_s"]
    return {k: (tok, s) for k, (tok, s) in out.items()}
