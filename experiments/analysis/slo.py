"""Latency targets (`workload.slo`) judged against the baseline, per level: goodput of option and baseline with the
paired interval of their ratio, each targeted latency's p99 in both with the paired interval of its ratio, and the
level's verdict -- `breaks_slo` where the option misses a target that the baseline meets (whatever its
throughput), else the throughput verdict. Read from the runs' records, with the summary's definitions
(experiments/harness/summary.py: a request is good when it finished within every target, a one-token answer's
TPOT is 0; the p99 is over the finished requests, TPOT's over those of more than one token)."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from experiments.analysis.stats import paired_percentile_ratio, paired_speedup, prompts_to_decide, verdict

BREAKS_SLO = "breaks_slo"
CONTAMINATED = "contaminated"


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("error") and r.get("e2e_s")]


def latency(record: dict, name: str) -> float | None:
    """A finished request's TTFT, TPOT or e2e in seconds (TPOT of a one-token answer: 0)."""
    if name != "tpot":
        return record.get(f"{name}_s")
    n = len(record["output_token_ids"])
    return (record["e2e_s"] - record["ttft_s"]) / (n - 1) if n > 1 and record.get("ttft_s") is not None else 0.0


def good(record: dict, targets: dict[str, float]) -> bool:
    if record.get("error") or not record.get("e2e_s"):
        return False
    return all((v := latency(record, name)) is not None and v <= t for name, t in targets.items())


def _p99_values(records: list[dict], name: str) -> dict[str, list[float]]:
    """prompt id -> the values its requests give the p99 (TPOT: answers of more than one token only)."""
    out: dict[str, list[float]] = defaultdict(list)
    for r in _ok(records):
        if name == "tpot" and len(r["output_token_ids"]) < 2:
            continue
        if (v := latency(r, name)) is not None:
            out[r["prompt_id"]].append(v)
    return out


def _goodput_totals(records: list[dict], targets: dict[str, float], closed: bool) -> dict[str, tuple[float, float]]:
    """prompt id -> (good requests, e2e seconds): closed loop, a level's wall is Σe2e / c for either arm, so the
    ratio of Σgood / Σe2e is the goodput ratio; open loop, both arms see the same arrivals, so it is the ratio of
    the shares of good requests (seconds: one per request)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        out[r["prompt_id"]][0] += good(r, targets)
        out[r["prompt_id"]][1] += (r.get("e2e_s") or 0.0) if closed else 1.0
    return {k: (g, s) for k, (g, s) in out.items() if s > 0}


def _latency_row(name: str, target: float, opt: list[dict], base: list[dict]) -> dict[str, Any]:
    o, b = _p99_values(opt, name), _p99_values(base, name)
    p99 = float(np.percentile([v for vs in o.values() for v in vs], 99)) if o else None
    base_p99 = float(np.percentile([v for vs in b.values() for v in vs], 99)) if b else None
    iv = paired_percentile_ratio(o, b)
    return {"target_s": target, "p99_s": p99, "baseline_p99_s": base_p99, "ratio": iv.estimate,
            "ratio_low": iv.low, "ratio_high": iv.high, "met": p99 is None or p99 <= target,
            "baseline_met": base_p99 is None or base_p99 <= target}


def level_slo(opt: list[dict], base: list[dict], targets: dict[str, float], closed: bool = True) -> dict[str, Any]:
    """One level's SLO row: goodput shares and ratio with its paired interval and verdict, each target's p99 row,
    and the targets the option breaks (misses where the baseline meets them)."""
    g_opt, g_base = _goodput_totals(opt, targets, closed), _goodput_totals(base, targets, closed)
    defined = sum(g for g, _ in g_base.values()) > 0
    iv = paired_speedup(g_opt, g_base) if defined else None
    lat = {name: _latency_row(name, t, opt, base) for name, t in targets.items()}
    return {"targets": dict(targets), "slo_share": _share(opt, targets), "baseline_slo_share": _share(base, targets),
            "goodput_ratio": iv.estimate if iv else None, "goodput_low": iv.low if iv else None,
            "goodput_high": iv.high if iv else None, "n_prompts": len(g_opt.keys() & g_base.keys()),
            "goodput_verdict": verdict(iv) if iv else "baseline meets no request's targets",
            "goodput_prompts_to_decide": prompts_to_decide(iv) if iv else None, "latency": lat,
            "breaks": [name for name, row in lat.items() if row["baseline_met"] and not row["met"]]}


def _share(records: list[dict], targets: dict[str, float]) -> float | None:
    return sum(good(r, targets) for r in records) / len(records) if records else None


def slo_levels(option_records: list[dict], baseline_records: list[dict], targets: dict[str, float],
               closed: bool = True) -> dict[int, dict[str, Any]]:
    """concurrency -> level_slo, for the levels both runs measured; none without targets."""
    if not targets:
        return {}
    levels = sorted({r["concurrency"] for r in option_records} & {r["concurrency"] for r in baseline_records})
    return {c: level_slo([r for r in option_records if r["concurrency"] == c],
                         [r for r in baseline_records if r["concurrency"] == c], targets, closed) for c in levels}


def level_verdict(throughput: str, slo_row: dict[str, Any] | None) -> str:
    """`breaks_slo` where the option misses a target the baseline meets, else the throughput verdict."""
    return BREAKS_SLO if slo_row and slo_row["breaks"] else throughput


def as_metrics(levels: dict[int, dict[str, Any]]) -> dict[str, float]:
    """slo/goodput_ratio_c<c>[_low|_high], slo/<name>_p99_ratio_c<c>[_low|_high], slo/breaks_c<c>."""
    out: dict[str, float] = {}
    for c, row in levels.items():
        named = {f"goodput_ratio_c{c}": row["goodput_ratio"], f"goodput_ratio_c{c}_low": row["goodput_low"],
                 f"goodput_ratio_c{c}_high": row["goodput_high"], f"breaks_c{c}": float(len(row["breaks"]))}
        for name, lat in row["latency"].items():
            named |= {f"{name}_p99_ratio_c{c}": lat["ratio"], f"{name}_p99_ratio_c{c}_low": lat["ratio_low"],
                      f"{name}_p99_ratio_c{c}_high": lat["ratio_high"]}
        out |= {f"slo/{k}": float(v) for k, v in named.items() if v is not None and np.isfinite(v)}
    return out


def log_level_verdicts(client: Any, run_id: str, throughput: dict[int, str], levels: dict[int, dict[str, Any]],
                       contaminated: bool) -> dict[int, str]:
    """Tag `specws.verdict_c<c>` on the option's run (`contaminated` when the contamination check flagged it),
    log the SLO rows as `slo.json` and their metrics; returns the verdicts."""
    verdicts = {c: CONTAMINATED if contaminated else level_verdict(v, levels.get(c)) for c, v in throughput.items()}
    for c, v in verdicts.items():
        client.set_tag(run_id, f"specws.verdict_c{c}", v)
    if levels:
        for key, value in as_metrics(levels).items():
            client.log_metric(run_id, key, value)
        client.log_dict(run_id, {str(c): row | {"verdict": verdicts.get(c)} for c, row in levels.items()}, "slo.json")
    return verdicts
