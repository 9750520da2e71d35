"""Per-category results of an option run against its baseline: accept length, per-position acceptance,
output tok/s and the speedup with its paired-bootstrap interval, per category x concurrency plus an "all"
row; and the post-run processor that logs them (with the contamination check) to the option's run.

Records without a `category` count as "all" (written before the key existed).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments.analysis.contamination import ContaminationCheck, check_contamination
from experiments.analysis.stats import (
    Interval,
    block_speedups,
    blocked_speedup,
    paired_speedup,
    prompt_blocks,
    prompt_totals,
    prompts_to_decide,
    ratio_interval,
    verdict_over_blocks,
)
from experiments.engines.base import RequestAcceptance

ALL = "all"
HIST_BIN = 0.25
Acceptor = Callable[[dict], RequestAcceptance | None]


def acceptor(engine: str) -> Acceptor:
    from experiments.engines import adapter_for
    return adapter_for(engine).request_acceptance


def accept_length_of(acc: Acceptor) -> Callable[[dict], float | None]:
    """Per-request accept length (emitted / steps) for `check_contamination`."""
    def accept(record: dict) -> float | None:
        a = acc(record)
        return a.accept_length if a is not None and a.steps else None
    return accept


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("error") and r.get("e2e_s")]


def _groups(records: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """(category, concurrency) -> records, with an ("all", c) group beside every level."""
    out: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in _ok(records):
        out[(ALL, r["concurrency"])].append(r)
        if (cat := r.get("category") or ALL) != ALL:
            out[(cat, r["concurrency"])].append(r)
    return out


def _acceptance(accs: list[RequestAcceptance]) -> dict[str, Any]:
    """Accept length = Σemitted / Σsteps (the requests' accept lengths weighted by their steps), with a
    bootstrap interval over requests; P(position i accepted) = Σ steps accepting i / Σ steps."""
    accs = [a for a in accs if a.steps]
    if not accs:
        return {"accept_length": None, "accept_length_low": None, "accept_length_high": None,
                "accept_per_position": []}
    iv = ratio_interval([a.emitted for a in accs], [a.steps for a in accs])
    with_pos = [a for a in accs if a.accepted_per_position]
    width = max((len(a.accepted_per_position) for a in with_pos), default=0)
    counts = np.zeros(width)
    for a in with_pos:
        counts[: len(a.accepted_per_position)] += a.accepted_per_position
    steps = sum(a.steps for a in with_pos)
    return {"accept_length": iv.estimate, "accept_length_low": iv.low, "accept_length_high": iv.high,
            "accept_per_position": (counts / steps).tolist() if steps else []}


def _tok_s(records: list[dict]) -> float | None:
    e2e = sum(r["e2e_s"] for r in records)
    return sum(len(r["output_token_ids"]) for r in records) / e2e if e2e > 0 else None


def _row(category: str, c: int, opt: list[dict], base: list[dict], acc: Acceptor) -> dict[str, Any]:
    o, b, blocks = prompt_totals(opt), prompt_totals(base), prompt_blocks(opt)
    prompts_only = paired_speedup(o, b)
    iv = blocked_speedup(o, b, blocks)
    per_block = block_speedups(o, b, blocks) if iv is not prompts_only and len(set(blocks.values())) > 1 else {}
    accs = [a for a in map(acc, opt) if a is not None]
    return {"category": category, "concurrency": c, "n_prompts": iv.n, "requests": len(opt),
            "output_tok_s": _tok_s(opt), "baseline_output_tok_s": _tok_s(base) if base else None,
            "speedup": iv.estimate, "speedup_low": iv.low, "speedup_high": iv.high, "method": iv.method,
            "speedup_prompts_low": prompts_only.low, "speedup_prompts_high": prompts_only.high,
            **_block_spread(per_block),
            "verdict": verdict_over_blocks(iv, per_block) if iv.n else "no baseline",
            "prompts_to_decide": prompts_to_decide(iv), **_acceptance(accs)}


def _block_spread(per_block: dict[int, Interval]) -> dict[str, Any]:
    """The blocks' own speedups: how many, their lowest and highest, each block's estimate."""
    if not per_block:
        return {"blocks": 1}
    est = [iv.estimate for iv in per_block.values()]
    return {"blocks": len(per_block), "block_speedup_min": min(est), "block_speedup_max": max(est),
            "block_speedups": est}


def category_rows(option_records: list[dict], baseline_records: list[dict] | None, acc: Acceptor) -> list[dict]:
    """One row per (category, concurrency), "all" first at each level; speedup over the prompts both served
    (none without baseline records: verdict "no baseline")."""
    opt, base = _groups(option_records), _groups(baseline_records or [])
    keys = sorted(opt, key=lambda k: (k[1], k[0] != ALL, k[0]))
    return [_row(cat, c, opt[(cat, c)], base.get((cat, c), []), acc) for cat, c in keys]


def distinct_rows(rows: list[dict]) -> list[dict]:
    """`category_rows` as a reader needs them: a level whose requests all fall in one category gets its "all" row
    only (that category's row would repeat it)."""
    cats: dict[int, set[str]] = defaultdict(set)
    every = {r["concurrency"]: r["requests"] for r in rows if r["category"] == ALL}
    for r in rows:
        if r["category"] != ALL:
            cats[r["concurrency"]].add(r["category"])
    return [r for r in rows if r["category"] == ALL or len(cats[r["concurrency"]]) > 1
            or r["requests"] != every.get(r["concurrency"])]


def metric_name(category: str) -> str:
    """A category as MLflow allows it in a metric name (letters, digits, _ - . space /)."""
    return re.sub(r"[^\w.\- ]", "_", category) or "_"


def as_metrics(rows: list[dict]) -> dict[str, float]:
    """cat/<category>/speedup_c<c>[_low|_high], cat/<category>/accept_length_c<c>, .../output_tok_s_c<c>,
    .../prompts_c<c>; missing numbers are left out."""
    out: dict[str, float] = {}
    for row in rows:
        head, c = f"cat/{metric_name(row['category'])}", row["concurrency"]
        names = {"speedup": f"speedup_c{c}", "speedup_low": f"speedup_c{c}_low", "speedup_high": f"speedup_c{c}_high",
                 "speedup_prompts_low": f"speedup_c{c}_prompts_low",
                 "speedup_prompts_high": f"speedup_c{c}_prompts_high",
                 "block_speedup_min": f"speedup_c{c}_block_min", "block_speedup_max": f"speedup_c{c}_block_max",
                 "accept_length": f"accept_length_c{c}", "output_tok_s": f"output_tok_s_c{c}",
                 "n_prompts": f"prompts_c{c}"}
        for key, name in names.items():
            value = row.get(key)
            if value is not None and np.isfinite(value):
                out[f"{head}/{name}"] = float(value)
    return out


def accept_length_hist(option_records: list[dict], acc: Acceptor) -> dict[str, Any]:
    """Per-request accept lengths by concurrency, with counts over bins of HIST_BIN tokens from 1."""
    values: dict[int, list[float]] = defaultdict(list)
    for r in _ok(option_records):
        if (a := acc(r)) is not None and a.steps:
            values[r["concurrency"]].append(a.accept_length)
    top = max((max(v) for v in values.values()), default=1.0)
    edges = np.arange(1.0, top + 2 * HIST_BIN, HIST_BIN)
    return {"bin_edges": edges.tolist(),
            "counts": {str(c): np.histogram(v, edges)[0].tolist() for c, v in sorted(values.items())},
            "values": {str(c): v for c, v in sorted(values.items())}}


def hist_figure(hist: dict[str, Any]):
    from experiments.tracking.plots import accept_length_histogram
    return accept_length_histogram(hist)


def log_category_results(client: Any, run_id: str, option_records: list[dict], baseline_records: list[dict] | None,
                         engine: str) -> tuple[list[dict], ContaminationCheck]:
    """Post-run processor for a measured option run (MlflowClient or OfflineClient): logs cat/* metrics,
    categories.json, accept_length_hist.json + plots/accept_length_distribution.png, and the contamination
    check (tag specws.contamination, contamination_* metrics)."""
    acc = acceptor(engine)
    rows = category_rows(option_records, baseline_records, acc)
    check = check_contamination(option_records, accept_length_of(acc))
    for key, value in (as_metrics(rows) | check.as_metrics()).items():
        client.log_metric(run_id, key, value)
    client.set_tag(run_id, "specws.contamination", check.as_tag()[:1000])
    client.log_dict(run_id, {"rows": rows, "contamination": vars(check)}, "categories.json")
    hist = accept_length_hist(option_records, acc)
    client.log_dict(run_id, hist, "accept_length_hist.json")
    if hist["values"]:
        from experiments.tracking.plots import plt
        fig = hist_figure(hist)
        client.log_figure(run_id, fig, "plots/accept_length_distribution.png")
        plt.close(fig)
    return rows, check
