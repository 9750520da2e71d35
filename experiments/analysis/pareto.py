"""Throughput against per-user speed across every measured setting (option x draft setting, and no speculation) and
load: per workload, tok/s per user (Σ output tokens / Σ request e2e of the level's finished requests: the rate one
stream sees, TTFT included) and TPOT p50 against the aggregate output tok/s of the level (tokens / the level's
wall). A point is on the frontier when no other point of its workload has at least its aggregate tok/s and at
least its per-user rate (at most its TPOT), one of them strictly better."""
from __future__ import annotations

import textwrap
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from experiments.analysis.recommend.decision import NO_SPECULATION, Load, choice_label
from experiments.analysis.report.figure import panel_titles
from experiments.analysis.runs import run_config
from experiments.analysis.speedup.model import levels_of


@dataclass(frozen=True)
class ParetoPoint:
    setting: str
    workload: str              # the workload's name (its panel)
    prompt_set: str | None     # what it sends (the panel's title)
    load: str
    concurrency: int
    aggregate_tok_s: float
    per_user_tok_s: float
    tpot_p50_ms: float | None
    runs: int                  # runs averaged into the point


def _setting(run) -> str:
    config = run_config(run)
    if not config.spec.speculative:
        return NO_SPECULATION
    return choice_label(config)


def _per_user(records: list[dict], c: int) -> float | None:
    ok = [r for r in records if r["concurrency"] == c and not r.get("error") and r.get("e2e_s")]
    e2e = sum(r["e2e_s"] for r in ok)
    return sum(len(r["output_token_ids"]) for r in ok) / e2e if e2e > 0 else None


def pareto_points(options: list, all_runs: list, records) -> list[ParetoPoint]:
    """One point per (setting, workload, load): the option runs and the baselines they are paired with, each
    measured run's levels, averaged over the runs of one setting."""
    by_id = {r.info.run_id: r for r in all_runs}
    runs = {r.info.run_id: r for r in options} | {
        rid: by_id[rid] for r in options if (rid := r.data.tags["specws.baseline_run_id"]) in by_id}
    found: dict[tuple, list[tuple]] = defaultdict(list)
    for run in runs.values():
        cfg, m = run_config(run), run.data.metrics
        for c in levels_of(m):
            user = _per_user(records(run.info.run_id), c)
            if user is not None:
                load = Load(cfg.arrival, cfg.rate, c)
                found[(_setting(run), cfg.workload or "?", cfg.prompt_set, load)].append(
                    (m[f"output_tok_s_c{c}"], user, m.get(f"tpot_p50_ms_c{c}")))
    out = []
    for (setting, workload, prompt_set, load), values in sorted(found.items(),
                                                               key=lambda kv: (kv[0][1], kv[0][0], kv[0][3])):
        tpots = [v[2] for v in values if v[2] is not None]
        out.append(ParetoPoint(setting, workload, prompt_set, load.label, load.concurrency,
                               float(np.mean([v[0] for v in values])), float(np.mean([v[1] for v in values])),
                               float(np.mean(tpots)) if tpots else None, len(values)))
    return out


def frontier(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mask of the points no other point dominates (higher is better in both)."""
    x, y = np.asarray(x, float)[:, None], np.asarray(y, float)[:, None]
    beaten = (x.T >= x) & (y.T >= y) & ((x.T > x) | (y.T > y))
    return ~beaten.any(axis=1)


def as_json(points: list[ParetoPoint]) -> dict[str, Any]:
    rows = []
    for workload in sorted({p.workload for p in points}):
        mine = [p for p in points if p.workload == workload]
        user = frontier([p.aggregate_tok_s for p in mine], [p.per_user_tok_s for p in mine])
        tpot = _tpot_frontier(mine)
        rows += [asdict(p) | {"frontier_per_user": bool(u), "frontier_tpot": bool(t)}
                 for p, u, t in zip(mine, user, tpot, strict=True)]
    return {"points": rows}


def _tpot_frontier(points: list[ParetoPoint]) -> np.ndarray:
    known = np.array([p.tpot_p50_ms is not None for p in points])
    tpot = np.array([-(p.tpot_p50_ms or 0.0) for p in points])
    mask = np.zeros(len(points), bool)
    if known.any():
        mask[known] = frontier(np.array([p.aggregate_tok_s for p in points])[known], tpot[known])
    return mask


def _panel(ax: Any, points: list[ParetoPoint], y: list[float], on: np.ndarray, ylabel: str) -> None:
    settings = sorted({p.setting for p in points}, key=lambda s: (s != NO_SPECULATION, s))
    markers = "os^Dv<>pPX*h"
    for i, setting in enumerate(settings):
        idx = [j for j, p in enumerate(points) if p.setting == setting]
        ax.scatter([points[j].aggregate_tok_s for j in idx], [y[j] for j in idx], marker=markers[i % len(markers)],
                   s=40, label=setting, zorder=3)
    for p, yv in zip(points, y, strict=True):
        ax.annotate(p.load.replace(" req/s", "/s"), (p.aggregate_tok_s, yv), textcoords="offset points",
                    xytext=(4, 3), fontsize=7)
    order = sorted(np.flatnonzero(on), key=lambda j: points[j].aggregate_tok_s)
    ax.plot([points[j].aggregate_tok_s for j in order], [y[j] for j in order], "-", color="0.2", lw=2.5, alpha=0.35,
            zorder=2, label="frontier")
    ax.scatter([points[j].aggregate_tok_s for j in order], [y[j] for j in order], s=140, facecolors="none",
               edgecolors="0.2", zorder=4)
    ax.set_xlabel("aggregate output tok/s")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def pareto_figure(points: list[ParetoPoint], title: str) -> Any:
    """Per workload a row: tok/s per user and TPOT p50 against aggregate tok/s, the frontier drawn and ringed."""
    from experiments.tracking.plots import plt
    workloads = sorted({p.workload for p in points}) or ["(no points)"]
    titles = panel_titles(points)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.6 * len(workloads)), squeeze=False,
                             layout="constrained")
    for row, workload in zip(axes, workloads, strict=True):
        mine = [p for p in points if p.workload == workload]
        if not mine:
            continue
        _panel(row[0], mine, [p.per_user_tok_s for p in mine],
               frontier([p.aggregate_tok_s for p in mine], [p.per_user_tok_s for p in mine]), "tok/s per user")
        timed = [p for p in mine if p.tpot_p50_ms is not None]
        _panel(row[1], timed, [p.tpot_p50_ms for p in timed], _tpot_frontier(timed), "TPOT p50 (ms)")
        for ax, what in zip(row, ("per-user speed", "TPOT"), strict=True):
            ax.set_title("\n".join(textwrap.wrap(f"{titles[workload]}: {what} vs aggregate", 70)), fontsize=10)
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=11)
    return fig
