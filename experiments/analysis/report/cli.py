"""Decision report for a sweep or a set of runs: speedup vs concurrency per option against its baseline,
95 % confidence intervals, the forecast made before the option ran (run.forecast=true) with its interval and its
error against the measurement, the post-hoc speedup model (evaluated with the run's own acceptance) beside each
measurement, a verdict per option, per-category rows, and a contamination flag per run.

`python -m experiments.analysis.report <experiment name | parent run id> [--tracking-uri URI] [--out DIR]`
(or `--experiment <experiment name | parent run id>`, as `recommend` takes it)

Speedup and interval: (Σ output tokens / Σ request e2e seconds) of the option over its baseline's, on the
prompts both served, with a paired bootstrap over those prompts (experiments.analysis.stats). A configuration
measured in several runs pools their prompts (each run's prompt paired with its own baseline's); with 3 or
more runs the interval is widened to cover the t-interval over the runs' estimates as well, so run-to-run
machine noise is not hidden (with 2 runs a t-interval on 1 degree of freedom says nothing). The old
"t over repetitions" interval is gone: repetitions of one prompt set re-sent the same prompts, so they sampled
timing noise, not prompts (and, on engines that remember, measured the memory); the workload now draws
disjoint prompts per repetition, which the prompt bootstrap covers. Runs without records keep the t-interval
over runs' logged speedups. A configuration with a run flagged by the contamination check
(experiments.analysis.contamination) is marked "contaminated — not a verdict". A level whose option misses a
latency target (`workload.slo`) that its baseline meets is `breaks_slo` whatever its throughput
(experiments.analysis.slo). The page carries the recommendation per load (experiments.analysis.recommend) and
aggregate tok/s against per-user speed with its frontier (experiments.analysis.pareto). Writes one self-contained
HTML, its PNGs, the recommendation (JSON, Markdown) and the frontier's points, logs them to the parent run (or to
a new `report` run for an experiment), prints the path.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

from experiments.analysis.categories import ALL, category_rows, distinct_rows
from experiments.analysis.report.figure import figure
from experiments.analysis.report.inputs import (
    CONTAMINATED,
    Records,
    ReportInputError,
    add_target,
    config_key,
    contamination_of,
    iso,
    pooled_records,
    records_of,
    run_acceptor,
    select_runs,
    since_ms,
    target_of,
)
from experiments.analysis.report.page import page
from experiments.analysis.runs import run_config
from experiments.analysis.slo import BREAKS_SLO, level_verdict, slo_levels
from experiments.analysis.speedup.fit import ngram_sources, probe_b_tok, probe_slopes, replayed_tokens_per_step
from experiments.analysis.speedup.model import PredictionUnavailable, levels_of, predict_run
from experiments.analysis.words import few_prompts, levels_words
from experiments.tracking.lifecycle import tracked_run

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# the run selection lives in inputs.py; these names stay importable from here and from the package
__all__ = ["CONTAMINATED", "OptionSeries", "Point", "ReportInputError", "build_series", "main", "records_of",
           "select_runs", "t_interval", "verdict_of"]


def verdict_of(low: float, high: float) -> str:
    """Pays: the interval lies above 1; does not pay: below 1; inconclusive: it straddles 1."""
    return "pays" if low > 1.0 else "does not pay" if high < 1.0 else "inconclusive"


@dataclass
class Point:
    concurrency: int
    speedup: float
    low: float
    high: float
    ci: str                     # how the interval was made
    predicted: float | None     # the post-hoc model, evaluated after the run with the run's own acceptance
    runs: int
    logged: float | None = None           # the runs' logged wall-clock speedup (mean)
    prompts: int = 0
    to_decide: int | None = None          # prompts that would settle an inconclusive point
    forecast: float | None = None         # the forecast made before the run (mean over the runs that carry one)
    forecast_low: float | None = None     # its 95 % interval (means of the runs' bounds)
    forecast_high: float | None = None
    forecast_error: float | None = None   # forecast / speedup - 1, against this point's pooled paired speedup
    forecasts: int = 0                    # runs that carried a forecast
    slo: dict | None = None               # the latency targets' row at this level (experiments/analysis/slo.py)

    @property
    def throughput_verdict(self) -> str:
        return verdict_of(self.low, self.high)

    @property
    def verdict(self) -> str:
        """The throughput verdict, or breaks_slo where the option misses a latency target the baseline meets."""
        return level_verdict(self.throughput_verdict, self.slo)

    @property
    def forecast_verdict(self) -> str | None:
        """The forecast's own verdict from its interval; None without a forecast or without its interval."""
        if self.forecast_low is None or self.forecast_high is None:
            return None
        return verdict_of(self.forecast_low, self.forecast_high)

    def as_json(self) -> dict:
        return vars(self) | {"verdict": self.verdict, "throughput_verdict": self.throughput_verdict,
                             "forecast_verdict": self.forecast_verdict}


def _model_odd(p: Point) -> bool:
    """The post-hoc model cannot explain the measurement: outside its interval and > 25 % away."""
    return (p.predicted is not None and not p.low <= p.predicted <= p.high
            and abs(p.predicted - p.speedup) > 0.25 * p.speedup)


def _disagreements(points: dict[int, Point]) -> list[str]:
    """Where the forecast's verdict is not the measured one; where the post-hoc model cannot explain the point."""
    parts = []
    told = [f"{c} (forecast {p.forecast:.2f}x [{p.forecast_low:.2f}, {p.forecast_high:.2f}] {p.forecast_verdict}, "
            f"measured {p.speedup:.2f}x {p.throughput_verdict})" for c, p in sorted(points.items())
            if p.forecast_verdict is not None and p.forecast_verdict != p.throughput_verdict]
    if told:
        parts.append(f"forecast disagrees at {levels_words(told)}")
    # a measurement the model cannot explain is a cue to look at the pairing (a baseline measured on a busy
    # machine) before trusting the verdict
    odd = [f"{c} ({p.predicted:.2f}x)" for c, p in sorted(points.items()) if _model_odd(p)]
    if odd:
        parts.append(f"post-hoc model disagrees at {levels_words(odd)}: check the baseline pairing")
    return parts


@dataclass
class OptionSeries:
    label: str
    workload: str
    points: dict[int, Point] = field(default_factory=dict)
    categories: list[dict] = field(default_factory=list)
    contamination: dict[str, str] = field(default_factory=dict)    # run name (id) -> check
    prompt_set: str | None = None           # what the workload sends (a file by its name)

    @property
    def contaminated(self) -> bool:
        return any(tag.startswith("contaminated") for tag in self.contamination.values())

    def _levels(self) -> dict[str, list[int]]:
        levels: dict[str, list[int]] = defaultdict(list)
        for c, p in sorted(self.points.items()):
            levels[p.verdict].append(c)
        return levels

    def decision(self) -> str:
        """In one word or three: pays, does not pay, depends (on the load), inconclusive, or contaminated."""
        if self.contaminated:
            return CONTAMINATED
        levels = self._levels()
        pays, loses = bool(levels["pays"]), bool(levels["does not pay"] or levels[BREAKS_SLO])
        return ("depends" if pays and loses else "pays" if pays else "does not pay" if loses else "inconclusive")

    def verdict(self) -> str:
        """The verdict in words: "pays at c = 1 and 4", "depends: pays at c = 4; does not pay at c = 1", with the
        levels where the forecast or the post-hoc model disagrees."""
        levels = self._levels()
        parts = [f"{v} at {levels_words(levels[v])}"
                 for v in ("pays", "does not pay", BREAKS_SLO, "inconclusive") if levels[v]]
        text = "; ".join(parts + _disagreements(self.points))
        if self.contaminated:
            return f"{CONTAMINATED}: measured {text}"
        return f"depends: {text}" if self.decision() == "depends" else text

    def warning(self) -> str | None:
        """Too few prompts per level to decide on (experiments.analysis.words.few_prompts); None when enough."""
        counts = [p.prompts for p in self.points.values() if p.prompts]
        return few_prompts(self.workload, min(counts)) if counts else None


def t_interval(values: list[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return float(v.mean() - half), float(v.mean() + half)


def _point(c: int, row: dict | None, per_run: list[float], logged: list[float], predicted: float | None) -> Point:
    if row is None or not row["n_prompts"]:        # no records: the runs' logged speedups
        lo, hi = t_interval(logged) if len(logged) >= 2 else (float(np.mean(logged)),) * 2
        how = f"t over {len(logged)} runs" if len(logged) >= 2 else "none (no records)"
        return Point(c, float(np.mean(logged)), lo, hi, how, predicted, len(logged), float(np.mean(logged)))
    lo, hi, how = row["speedup_low"], row["speedup_high"], row["method"]
    if len(per_run) >= 3:
        t_lo, t_hi = t_interval(per_run)
        lo, hi, how = min(lo, t_lo), max(hi, t_hi), f"{how} of {len(per_run)} runs, widened to t over the runs"
    elif len(per_run) == 2:
        how = f"{how} of 2 runs (run-to-run noise not in the interval)"
    return Point(c, row["speedup"], lo, hi, how, predicted, len(logged), float(np.mean(logged)),
                 row["n_prompts"], row["prompts_to_decide"])


def _logged(runs: list, by_id: dict, c: int) -> list[float]:
    """The runs' logged wall-clock speedups at concurrency c (output_tok_s_c<c> over the baseline's)."""
    key, out = f"output_tok_s_c{c}", []
    for run in runs:
        base = by_id[run.data.tags["specws.baseline_run_id"]].data.metrics
        if run.data.metrics.get(key) and base.get(key):
            out.append(run.data.metrics[key] / base[key])
    return out


def _series(label: str, workload: str, runs: list, by_id: dict, records: Records, predictions: dict) -> OptionSeries:
    config = run_config(runs[0])
    s = OptionSeries(label, workload, prompt_set=config.prompt_set)
    acc = run_acceptor(runs[0])
    pooled = pooled_records(runs, records)
    rows = category_rows(*pooled, acc)
    slo = slo_levels(*pooled, config.slo_targets, config.closed)
    s.categories = distinct_rows(rows)
    single = [category_rows(*pooled_records([run], records), acc) for run in runs] if len(runs) >= 3 else []
    for run in runs:
        s.contamination[f"{run.info.run_name} ({run.info.run_id[:8]})"] = contamination_of(
            run, records(run.info.run_id))
    for c in sorted({c for run in runs for c in levels_of(run.data.metrics)}):
        logged = _logged(runs, by_id, c)
        if not logged:
            continue
        row = next((r for r in rows if r["category"] == ALL and r["concurrency"] == c), None)
        per_run = [r["speedup"] for rr in single for r in rr if r["category"] == ALL and r["concurrency"] == c]
        preds = [p[f"predicted_speedup_c{c}"] for p in predictions.values() if f"predicted_speedup_c{c}" in p]
        s.points[c] = _with_forecast(_point(c, row, per_run, logged, float(np.mean(preds)) if preds else None),
                                     runs)
        s.points[c].slo = slo.get(c)
    return s


def _mean_of(found: list[list[float | None]], i: int) -> float | None:
    values = [f[i] for f in found]
    return float(np.mean(values)) if all(v is not None for v in values) else None


def _with_forecast(p: Point, runs: list) -> Point:
    """The point with the forecast its runs carry (forecast_check's forecast_speedup[_low|_high]_c<c>): the mean
    over the runs that carry one, its error against the point's own measured speedup."""
    c = p.concurrency
    keys = [f"forecast_speedup{part}_c{c}" for part in ("", "_low", "_high")]
    found = [[run.data.metrics.get(k) for k in keys] for run in runs if keys[0] in run.data.metrics]
    if not found:
        return p
    p.forecast, p.forecast_low, p.forecast_high = (_mean_of(found, i) for i in range(3))
    p.forecast_error, p.forecasts = p.forecast / p.speedup - 1.0, len(found)
    return p


def build_series(client, options: list, all_runs: list, records: Records | None = None) -> list[OptionSeries]:
    by_id = {r.info.run_id: r for r in all_runs}
    ngram = ngram_sources(client, options)
    slopes = probe_slopes(ngram_sources(client, [r for r in all_runs if run_config(r).spec.method == "ngram"]))
    groups = _groups([run for run in options if run.data.tags["specws.baseline_run_id"] in by_id])
    records = records or Records(client)
    series = []
    for (label, workload), runs in sorted(groups.items()):
        predictions = {run.info.run_id: _prediction(run, by_id[run.data.tags["specws.baseline_run_id"]], ngram,
                                                    slopes) for run in runs}
        series.append(_series(label, workload, runs, by_id, records, predictions))
    return series


def _groups(options: list) -> dict[tuple[str, str], list]:
    """(configuration in words, workload) -> its runs; a configuration measured on two engines is two, each
    named with its engine."""
    by: dict[tuple[str, str, str], list] = defaultdict(list)
    for run in options:
        by[(*config_key(run), run_config(run).engine)].append(run)
    engines = Counter((label, workload) for label, workload, _ in by)
    return {(label if engines[(label, workload)] == 1 else f"{label} ({engine})", workload): runs
            for (label, workload, engine), runs in by.items()}


def _prediction(run, base, ngram: dict, slopes: dict) -> dict:
    """The run's logged predicted_* metrics, else the speedup model evaluated now."""
    logged = {k: v for k, v in run.data.metrics.items() if k.startswith("predicted_speedup_c")}
    if logged:
        return logged
    replayed = replayed_tokens_per_step(*ngram[run.info.run_id]) if run.info.run_id in ngram else None
    try:
        return predict_run(run.data.metrics, run_config(run), base.data.metrics, tokens_per_step=replayed,
                           b_tok_ms=probe_b_tok(slopes, exclude=run.info.run_id))
    except PredictionUnavailable:
        return {}


def main(argv: list[str] | None = None) -> int:
    import mlflow
    from mlflow.tracking import MlflowClient
    from rich.console import Console
    from rich.markup import escape

    from experiments.config.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.report", description=__doc__.split("\n\n")[0])
    add_target(ap)
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    ap.add_argument("--out", type=Path, default=ROOT / "mlruns" / "reports")
    ap.add_argument("--since", type=since_ms, default=None, metavar="ISO-TIME",
                    help="only runs started at or after this UTC time, e.g. 2026-11-30T21:00 (one lease's runs)")
    args = ap.parse_args(argv)
    args.target = target_of(ap, args)
    console = Console(stderr=True)
    mlflow.set_tracking_uri(args.tracking_uri)
    client = MlflowClient()
    try:
        options, all_runs, exp_id, parent = select_runs(client, args.target, args.since)
    except ReportInputError as exc:
        console.print(f"[bold red]report refused:[/] {exc}", soft_wrap=True)
        return 2
    title = f"Speculative decoding: {args.target if parent is None else parent.info.run_name or args.target}" + (
        "" if args.since is None else f", runs since {iso(args.since)}")
    stem = args.target.replace("/", "_").replace("@", "_") + ("" if args.since is None else
                                                              f"-since-{iso(args.since).replace(':', '')}")
    records = Records(client)
    series = build_series(client, options, all_runs, records)
    existing = set(args.out.glob(f"*-{stem}.*"))
    paths, verdicts = _write(client, options, all_runs, records, series, title, args.out, stem)
    if parent is not None:  # a sweep's report goes onto its parent run
        _log_report(client, parent.info.run_id, paths, verdicts)
    else:
        with tracked_run(client, exp_id, f"report-{stem}"[:250], {"specws.mode": "report"}) as run:
            _log_report(client, run.id, paths, verdicts)
    for s in series:
        console.print(f"[bold]{escape(s.label)}[/] on {escape(s.workload)}: {escape(s.verdict())}", soft_wrap=True)
        if s.warning():
            console.print(f"[bold yellow]warning:[/] {escape(s.label)} on {escape(s.workload)}: {s.warning()}",
                          soft_wrap=True)
    for path in sorted(p for p in paths.values() if p in existing):
        console.print(f"replaced {path}", soft_wrap=True, highlight=False)
    print(paths["html"])
    return 0


def _png(fig) -> bytes:
    from experiments.tracking.plots import plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _write(client, options: list, all_runs: list, records: Records, series: list, title: str, out: Path,
           stem: str) -> tuple[dict[str, Path], dict]:
    """The report's files under `out`: the HTML page, its speedup figure, the throughput vs per-user speed figure
    and its points, the recommendation (JSON, Markdown); returns their paths and the verdicts."""
    from experiments.analysis.pareto import as_json, pareto_figure, pareto_points
    from experiments.analysis.recommend import build, write
    from experiments.analysis.recommend.render import html_section
    out.mkdir(parents=True, exist_ok=True)
    recs = build(client, options, all_runs, records)
    points = pareto_points(options, all_runs, records)
    png, frontier = _png(figure(series, title)), _png(pareto_figure(points, f"{title}: throughput vs per-user speed"))
    paths = {"png": out / f"report-{stem}.png", "pareto": out / f"pareto-{stem}.png",
             "html": out / f"report-{stem}.html", "pareto_json": out / f"pareto-{stem}.json"}
    paths["png"].write_bytes(png)
    paths["pareto"].write_bytes(frontier)
    paths["pareto_json"].write_text(json.dumps(as_json(points), indent=1))
    telemetry = _telemetry(client, options, all_runs, out / f"telemetry-{stem}.png", paths)
    from experiments.analysis.report.host import html_section as host_section
    host = host_section(client, options, all_runs)
    paths["html"].write_text(page(series, png, title, html_section(recs), frontier, telemetry, host))
    paths["recommendation_json"], paths["recommendation_md"] = write(recs, out, stem, title)
    verdicts = {f"{s.label} | {s.workload}": {
        "verdict": s.verdict(), "decision": s.decision(), "warning": s.warning(), "contaminated": s.contaminated,
        "contamination": s.contamination, "prompt_set": s.prompt_set,
        "points": {c: p.as_json() for c, p in s.points.items()}, "categories": s.categories} for s in series}
    return paths, verdicts


def _telemetry(client, options: list, all_runs: list, path: Path, paths: dict[str, Path]) -> str:
    """The Telemetry section's HTML over the options and their baselines; its figure into `path` (and `paths`)
    when any run has samples."""
    from experiments.analysis.report.telemetry import html_section, telemetry_figure, telemetry_of
    by_id = {r.info.run_id: r for r in all_runs}
    bases = {r.data.tags.get("specws.baseline_run_id") for r in options}
    runs = telemetry_of(client, list({r.info.run_id: r for r in options + [by_id[b] for b in bases
                                                                             if b in by_id]}.values()))
    fig = telemetry_figure(runs) if any(t.has_gpu for t in runs) else None   # no GPU: one line, no figure
    png = None if fig is None else _png(fig)
    if png is not None:
        path.write_bytes(png)
        paths["telemetry"] = path
    return html_section(runs, png)


def _log_report(client, run_id: str, paths: dict[str, Path], verdicts: dict) -> None:
    for path in paths.values():
        client.log_artifact(run_id, str(path), "report")
    client.log_dict(run_id, verdicts, "report/verdicts.json")


if __name__ == "__main__":
    sys.exit(main())
