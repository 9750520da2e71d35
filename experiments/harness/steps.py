"""Server-side step times per level: each finished request's decode step (the engine adapter says from which
clock: SGLang's own timestamps, else the streamed chunks), their median and spread, and two flags that say the
step did not hold still within the level: `bimodal` (two groups of requests at clearly different steps, as
B's 3.1 against 4.7 ms on one H200) and `drifting` (the step moves with the order in which requests started)."""
from __future__ import annotations

import numpy as np
from scipy import stats

from experiments.engines.base import EngineAdapter

MIN_REQUESTS = 16           # fewer: no flags (a spread of a handful of requests says nothing)
BIMODAL_GAP = 0.20          # the two groups' medians differ by at least this share of the lower one
BIMODAL_SHARE = 0.15        # and each holds at least this share of the requests
DRIFT_RHO, DRIFT_P = 0.5, 0.01   # |Spearman rho| of step against start order, and its p-value


def step_metrics(records: list, adapter: EngineAdapter) -> dict[str, float]:
    """`step_p50_ms`, `step_p10_ms`, `step_p90_ms`, `step_requests`, `step_bimodal`, `step_drifting` over the
    level's finished requests (records as client.RequestRecord or their dicts); empty without any step."""
    rows = [(_get(r, "start_s") or 0.0, adapter.request_step_s(_as_dict(r))) for r in records]
    rows = sorted((t, s) for t, s in rows if s is not None and np.isfinite(s) and s > 0)
    if not rows:
        return {}
    steps_ms = np.array([s for _, s in rows]) * 1000.0
    p10, p50, p90 = np.percentile(steps_ms, [10, 50, 90])
    return {"step_p50_ms": float(p50), "step_p10_ms": float(p10), "step_p90_ms": float(p90),
            "step_requests": float(len(steps_ms)), "step_bimodal": float(bimodal(steps_ms)),
            "step_drifting": float(drifting(steps_ms))}


def bimodal(values: np.ndarray) -> bool:
    """Two groups: the best split of the sorted values (the one that leaves the least spread within the groups),
    each group holding at least BIMODAL_SHARE of them, medians BIMODAL_GAP apart, and the gap between the groups
    wider than the spread inside the wider group (a long tail is not a second mode)."""
    v = np.sort(np.asarray(values, dtype=float))
    n = len(v)
    if n < MIN_REQUESTS:
        return False
    lo_cut = max(1, int(np.ceil(BIMODAL_SHARE * n)))
    cuts = range(lo_cut, n - lo_cut + 1)
    if not cuts:
        return False
    cut = min(cuts, key=lambda k: v[:k].var() * k + v[k:].var() * (n - k))
    low, high = v[:cut], v[cut:]
    gap = high[0] - low[-1]
    spread = max(np.percentile(low, 90) - np.percentile(low, 10), np.percentile(high, 90) - np.percentile(high, 10))
    return bool(np.median(high) >= (1 + BIMODAL_GAP) * np.median(low) and gap > spread)


def drifting(values_in_start_order: np.ndarray) -> bool:
    """The step moves with the requests' start order (Spearman's rank correlation)."""
    v = np.asarray(values_in_start_order, dtype=float)
    if len(v) < MIN_REQUESTS or np.ptp(v) == 0:
        return False
    rho, p = stats.spearmanr(np.arange(len(v)), v)
    return bool(abs(rho) >= DRIFT_RHO and p <= DRIFT_P)


def step_excess(option: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """Per level, the option's median step over the baseline's: `step_excess_ms_c<c>` (difference) and
    `step_ratio_c<c>` (ratio)."""
    out = {}
    for name, value in option.items():
        if name.startswith("step_p50_ms_c") and baseline.get(name):
            level = name.removeprefix("step_p50_ms_c")
            out[f"step_excess_ms_c{level}"] = value - baseline[name]
            out[f"step_ratio_c{level}"] = value / baseline[name]
    return out


def _get(record, key: str):
    return record.get(key) if isinstance(record, dict) else getattr(record, key, None)


def _as_dict(record) -> dict:
    return record if isinstance(record, dict) else vars(record)
