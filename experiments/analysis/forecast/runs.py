"""Forecast runs and their check: `python -m experiments.run +option=A run.forecast=true` finds or measures the
baseline, then `log_forecast` fills a run of its own (tag `specws.mode=forecast`) with the option's predicted
speedup per level and category (experiments/analysis/speedup/forecast.py), before any option server starts. The
measured run of the same option that follows gets the forecast's error per level (`forecast_check`, a post-run
processor).

Inputs, each named when missing (the run then says `not forecast: ...` and predicts nothing): the baseline's
records, the option's acceptance offline on the baseline's outputs, the engine's step-cost profile."""
from __future__ import annotations

import hashlib
import time
from typing import Any

from experiments.analysis.runs import RunConfig, run_config
from experiments.analysis.speedup.forecast import Forecast, ForecastUnavailable, forecast
from experiments.analysis.speedup.offline_acceptance import AcceptanceUnavailable, offline_steps
from experiments.analysis.speedup.stepcost import HOST_TOLERANCE, ProfileMissing, find_profile, key_of
from experiments.analysis.stats import paired_speedup, prompt_totals
from experiments.tracking.records import run_records
from experiments.tracking.store import Metric

TAG = "specws.forecast"
SPEC_KEYS = ("engine.name", "model.name", "site.name", "limits.max_running_requests")


def option_digest(params: dict[str, str]) -> str:
    """What makes two runs the same option configuration: its speculation settings, engine, model, site, limits."""
    items = sorted((k, v) for k, v in params.items() if k.startswith("spec.") or k in SPEC_KEYS)
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def host_band(params: dict[str, str]) -> float | None:
    """`run.forecast_host_band` as the option's run logged it (the default where an older run did not)."""
    value = params.get("run.forecast_host_band")
    if value is None:
        return HOST_TOLERANCE
    return None if value in ("None", "null", "") else float(value)


def make_forecast(client: Any, baseline: Any, option: RunConfig, params: dict[str, str]) -> tuple[Forecast, str]:
    """The forecast and a note on its inputs; raises ForecastUnavailable naming a missing input."""
    records = run_records(client, baseline.info.run_id)
    if not records:
        raise ForecastUnavailable(f"the baseline run {baseline.info.run_id} has no records")
    try:
        profile, profile_note = find_profile(key_of(baseline))
        steps, acceptance_note = offline_steps(records, option, params)
    except (ProfileMissing, AcceptanceUnavailable) as exc:
        raise ForecastUnavailable(str(exc)) from None
    result = forecast(records, baseline.data.metrics, steps, option, profile, host_band(params))
    result.notes += [acceptance_note, f"{profile_note}: {profile.summary()}"]
    return result, "; ".join(result.notes)


def forecast_table(result: Forecast) -> list[str]:
    lines = ["| level | category | tokens/step | verified/step | regime | forecast speedup | 95 % interval | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for f in result.levels:
        lines.append(f"| c={f.concurrency} | {f.category} | {f.tokens_per_step:.2f} | {f.verified_per_step:.2f} | "
                     f"{f.regime} | {f.speedup:.2f}x | [{f.low:.2f}, {f.high:.2f}] | {f.verdict} |")
    return lines + [f"note: {n}" for n in result.notes] + [
        f"flag: {f.flag}" for f in result.levels if f.flag and f.category == "all"]


def log_forecast(client: Any, run_id: str, baseline: Any, params: dict[str, str]) -> list[str]:
    """Fill the forecast run `run_id`; returns the lines to print."""
    run = client.get_run(run_id)
    option = RunConfig.from_params(params, run.data.tags)
    client.set_tag(run_id, "specws.option_digest", option_digest(params))
    try:
        result, note = make_forecast(client, baseline, option, params)
    except ForecastUnavailable as exc:
        client.set_tag(run_id, TAG, f"not forecast: {exc}"[:5000])
        return [f"[bold red]not forecast[/]: {exc}"]
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in result.as_metrics().items()])
    for f in result.overall():
        client.set_tag(run_id, f"specws.forecast_verdict_c{f.concurrency}", f.verdict)
    client.set_tag(run_id, TAG, note[:5000])
    client.log_dict(run_id, result.to_json(), "forecast.json")
    return [f"forecast of option {option.option} against baseline {baseline.info.run_id}:", *forecast_table(result)]


def latest_forecast(client: Any, run: Any) -> Any | None:
    """The newest finished forecast of this run's option configuration against the same pairing key that predicted
    something (a forecast refused for a missing input is passed over)."""
    digest = option_digest(run.data.params)
    key = run.data.tags.get("specws.pair_key", "")
    found = client.search_runs([run.info.experiment_id],
                               f"tags.`specws.mode` = 'forecast' and tags.`specws.pair_key` = '{key}' and "
                               f"tags.`specws.option_digest` = '{digest}' and attributes.status = 'FINISHED'",
                               max_results=50, order_by=["attributes.start_time DESC"])
    return next((r for r in found if any(k.startswith("forecast_speedup_c") for k in r.data.metrics)), None)


def forecast_errors(forecast_metrics: dict[str, float], option_records: list[dict],
                    baseline_records: list[dict]) -> dict[str, float]:
    """Per level: the measured paired speedup, the forecast's relative error and whether the interval held it."""
    out = {}
    for c in sorted({int(r.get("concurrency") or 1) for r in option_records}):
        predicted = forecast_metrics.get(f"forecast_speedup_c{c}")
        if predicted is None:
            continue
        measured = paired_speedup(prompt_totals([r for r in option_records if r.get("concurrency") == c]),
                                  prompt_totals([r for r in baseline_records if r.get("concurrency") == c])).estimate
        low, high = forecast_metrics[f"forecast_speedup_low_c{c}"], forecast_metrics[f"forecast_speedup_high_c{c}"]
        out |= {f"forecast_speedup_c{c}": predicted, f"forecast_speedup_low_c{c}": low,
                f"forecast_speedup_high_c{c}": high, f"forecast_error_c{c}": predicted / measured - 1.0,
                f"forecast_covered_c{c}": float(low <= measured <= high)}
    return out


def forecast_check(client: Any, run_id: str, baseline: Any, engine: str = "") -> None:
    """Post-run: a measured option run carries the error of the forecast made before it (when there was one)."""
    run = client.get_run(run_id)
    if baseline is None or not run_config(run).spec.speculative:
        return
    found = latest_forecast(client, run)
    if found is None:
        client.set_tag(run_id, TAG, "no forecast was made for this configuration before it ran")
        return
    errors = forecast_errors(found.data.metrics, run_records(client, run_id) or [],
                             run_records(client, baseline.info.run_id) or [])
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in errors.items()])
    client.set_tag(run_id, "specws.forecast_run_id", found.info.run_id)
