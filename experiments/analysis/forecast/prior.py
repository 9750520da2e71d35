"""Forecasts as a prior for the recommendation: every configuration forecast in the experiment but never measured
is named with what its forecast says -- ruled out (its interval below 1 at every level forecast), or still open
(measure it). Reads the experiment's forecast runs (`specws.mode=forecast`, experiments/analysis/forecast/runs.py)
and the measured option runs; writes nothing (the recommendation prints and stores the lines)."""
from __future__ import annotations

from typing import Any

from experiments.analysis.forecast.runs import option_digest
from experiments.analysis.runs import run_config
from experiments.analysis.stats import LOSES
from experiments.analysis.words import config_words


def _levels(run: Any) -> list[tuple[int, float, float, float]]:
    m = run.data.metrics
    cs = sorted(int(k.rsplit("_c", 1)[1]) for k in m if k.startswith("forecast_speedup_c"))
    return [(c, m[f"forecast_speedup_c{c}"], m[f"forecast_speedup_low_c{c}"], m[f"forecast_speedup_high_c{c}"])
            for c in cs]


def prior_line(run: Any) -> str:
    """What one forecast says about measuring its configuration."""
    levels = _levels(run)
    shown = ", ".join(f"c={c} {s:.2f}x [{lo:.2f}, {hi:.2f}]" for c, s, lo, hi in levels)
    verdicts = {c: run.data.tags.get(f"specws.forecast_verdict_c{c}", "") for c, *_ in levels}
    config = run_config(run)
    if all(v == LOSES for v in verdicts.values()):
        return f"skipped: the forecast rules it out ({shown}: does not pay at every level)"
    open_at = ", ".join(f"c={c} {v}" for c, v in verdicts.items() if v != LOSES)
    return (f"not measured; the forecast leaves it open ({shown}; {open_at}): measure it, "
            f"python -m experiments.run +option={config.option} with the forecast's draft setting")


def forecast_prior(client: Any, exp_id: str, measured: list[Any]) -> dict[tuple[str, str], str]:
    """(workload, configuration "A: n-gram, 8 draft tokens") -> what its newest forecast says, for configurations
    forecast but not measured."""
    done = {option_digest(r.data.params) for r in measured}
    found = client.search_runs([exp_id], "tags.`specws.mode` = 'forecast' and attributes.status = 'FINISHED'",
                               max_results=1000, order_by=["attributes.start_time DESC"])
    out: dict[tuple[str, str], str] = {}
    for run in found:
        if option_digest(run.data.params) in done or not _levels(run):
            continue
        config = run_config(run)
        out.setdefault((config.workload or "?", config_words(config)), prior_line(run))
    return out
