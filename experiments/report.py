"""Decision report for a sweep or a set of runs: speedup vs concurrency per option against its baseline,
95 % confidence intervals, the speedup model's prediction beside each measurement, a verdict per option.

`python -m experiments.report <experiment name | parent run id> [--tracking-uri URI] [--out DIR]`

Confidence intervals: a configuration measured in several runs -> t-interval over the runs' speedups
(includes the machine's run-to-run noise); one run with workload.repetitions >= 2 -> t-interval over the
per-repetition throughputs from its records; one repetition -> bootstrap over its requests (and its
baseline's), which shows only request-to-request spread. Writes one self-contained HTML (figure + verdict
table) and the PNG, logs both to the parent run (or to a new `report` run for an experiment), prints the path.
"""
from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from scipy import stats

from experiments.speedup_model import PredictionUnavailable, levels_of, predict_run
from experiments.speedup_store import ngram_sources, probe_b_tok, probe_slopes, replayed_tokens_per_step

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
BOOTSTRAP = 2000


class ReportInputError(ValueError):
    """Nothing to report on; nothing was written."""


@dataclass
class Point:
    concurrency: int
    speedup: float
    low: float
    high: float
    ci: str                     # how the interval was made
    predicted: float | None
    runs: int


@dataclass
class OptionSeries:
    label: str
    workload: str
    points: dict[int, Point] = field(default_factory=dict)

    def verdict(self) -> str:
        pays = [c for c, p in sorted(self.points.items()) if p.low > 1.0]
        loses = [c for c, p in sorted(self.points.items()) if p.high < 1.0]
        unclear = [c for c in sorted(self.points) if c not in pays and c not in loses]
        parts = []
        if pays:
            parts.append(f"pays at c={','.join(map(str, pays))}")
        if loses:
            parts.append(f"does not pay at c={','.join(map(str, loses))}")
        if unclear:
            parts.append(f"inconclusive at c={','.join(map(str, unclear))}")
        # a measurement the model cannot explain (outside its interval, > 25 % away) is a cue to look at
        # the pairing (a baseline measured on a busy machine) before trusting the verdict
        odd = [f"{c} ({p.predicted:.2f}x)" for c, p in sorted(self.points.items()) if p.predicted is not None
               and not p.low <= p.predicted <= p.high and abs(p.predicted - p.speedup) > 0.25 * p.speedup]
        if odd:
            parts.append(f"model disagrees at c={', '.join(odd)}: check the baseline pairing")
        head = "pays" if pays and not loses else "does not pay" if loses and not pays else "depends"
        return f"{head}: " + "; ".join(parts)


def config_key(run) -> tuple[str, str]:
    p, t = run.data.params, run.data.tags
    method = p.get("spec.method", "none")
    detail = {"ngram": f"k={p.get('spec.num_draft_tokens')} match {p.get('spec.ngram.min_match')}-"
                       f"{p.get('spec.ngram.max_match')}",
              "eagle3": f"steps={p.get('spec.num_steps')} topk={p.get('spec.topk')}"}.get(method, "")
    return f"{t.get('specws.option')} {method} {detail}".strip(), t.get("specws.workload", "?")


def records_of(client, run_id: str) -> list[dict]:
    from experiments.client import load_records
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(client.download_artifacts(run_id, "records", tmp))
        except Exception:  # noqa: BLE001 - a run without records gets no request-level interval
            return []
        return [r for f in sorted(local.glob("*.jsonl")) for r in load_records(f)]


def _throughput(recs: list[dict]) -> float:
    """Concurrency-level throughput estimator from requests alone: c * tokens / request time."""
    tokens = sum(len(r["output_token_ids"]) for r in recs)
    busy = sum(r["e2e_s"] for r in recs)
    return recs[0]["concurrency"] * tokens / busy if busy else float("nan")


def per_repetition_tok_s(recs: list[dict]) -> list[float]:
    by_rep: dict[int, list[dict]] = defaultdict(list)
    for r in recs:
        by_rep[r["repetition"]].append(r)
    out = []
    for rs in by_rep.values():
        span = max(r["start_s"] + r["e2e_s"] for r in rs) - min(r["start_s"] for r in rs)
        out.append(sum(len(r["output_token_ids"]) for r in rs) / span if span > 0 else float("nan"))
    return out


def t_interval(values: list[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return float(v.mean() - half), float(v.mean() + half)


def single_run_interval(option_recs: list[dict], base_recs: list[dict], speedup: float,
                        rng: np.random.Generator) -> tuple[float, float, str]:
    if not option_recs or not base_recs:
        return speedup, speedup, "none (no records)"
    reps_o, reps_b = per_repetition_tok_s(option_recs), per_repetition_tok_s(base_recs)
    if len(reps_o) >= 2 and len(reps_b) >= 2:
        ratios = [o / np.mean(reps_b) for o in reps_o]
        return (*t_interval(ratios), f"t over {len(reps_o)} repetitions")
    estimate = _throughput(option_recs) / _throughput(base_recs)
    boots = []
    for _ in range(BOOTSTRAP):
        o = [option_recs[i] for i in rng.integers(0, len(option_recs), len(option_recs))]
        b = [base_recs[i] for i in rng.integers(0, len(base_recs), len(base_recs))]
        boots.append(_throughput(o) / _throughput(b))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    # the request-level estimator is not the level's wall-clock throughput: keep its relative spread
    return speedup * lo / estimate, speedup * hi / estimate, f"bootstrap over {len(option_recs)} requests"


def select_runs(client, target: str, since_ms: int | None = None) -> tuple[list, list, str, object | None]:
    """(speculative runs, all runs by which baselines are found, experiment id, parent run or None); with
    `since_ms`, only speculative runs started then or later (e.g. one lease of a GPU host)."""
    from mlflow.exceptions import MlflowException
    exp = client.get_experiment_by_name(target)
    parent = None
    if exp is None:
        try:
            parent = client.get_run(target)
        except MlflowException as exc:
            raise ReportInputError(f"{target!r} is neither an experiment nor a run in {client.tracking_uri}") from exc
        exp_id = parent.info.experiment_id
    else:
        exp_id = exp.experiment_id
    runs = client.search_runs([exp_id], "attributes.status = 'FINISHED' and tags.`specws.mode` = 'measure'",
                              max_results=5000)
    chosen = [r for r in runs if (parent is None or r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
              and (since_ms is None or r.info.start_time >= since_ms)]
    options = [r for r in chosen if r.data.params.get("spec.method", "none") != "none"
               and r.data.tags.get("specws.baseline_run_id")]
    if not options:
        since = "" if since_ms is None else f" started since {_iso(since_ms)}"
        raise ReportInputError(f"{target}: no finished speculative run with a paired baseline{since} to report on")
    return options, runs, exp_id, parent


def build_series(client, options: list, all_runs: list, seed: int = 0) -> list[OptionSeries]:
    by_id = {r.info.run_id: r for r in all_runs}
    ngram = ngram_sources(client, options)
    slopes = probe_slopes(ngram_sources(client, [r for r in all_runs
                                                 if r.data.params.get("spec.method") == "ngram"]))
    rng = np.random.default_rng(seed)
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for run in options:
        if run.data.tags["specws.baseline_run_id"] in by_id:
            groups[config_key(run)].append(run)
    series = []
    for (label, workload), runs in sorted(groups.items()):
        s = OptionSeries(label, workload)
        per_c: dict[int, list[tuple[float, float | None, object]]] = defaultdict(list)
        for run in runs:
            base = by_id[run.data.tags["specws.baseline_run_id"]]
            predicted = _prediction(run, base, ngram, slopes)
            for c in levels_of(run.data.metrics):
                if f"output_tok_s_c{c}" in base.data.metrics:
                    sp = run.data.metrics[f"output_tok_s_c{c}"] / base.data.metrics[f"output_tok_s_c{c}"]
                    per_c[c].append((sp, predicted.get(f"predicted_speedup_c{c}"), run))
        for c, entries in sorted(per_c.items()):
            speeds = [e[0] for e in entries]
            preds = [e[1] for e in entries if e[1] is not None]
            if len(entries) >= 2:
                lo, hi = t_interval(speeds)
                how = f"t over {len(entries)} runs"
            else:
                run = entries[0][2]
                base_id = run.data.tags["specws.baseline_run_id"]
                o = [r for r in records_of(client, run.info.run_id) if r["concurrency"] == c and not r.get("error")]
                b = [r for r in records_of(client, base_id) if r["concurrency"] == c and not r.get("error")]
                lo, hi, how = single_run_interval(o, b, speeds[0], rng)
            s.points[c] = Point(c, float(np.mean(speeds)), lo, hi, how,
                                float(np.mean(preds)) if preds else None, len(entries))
        series.append(s)
    return series


def _prediction(run, base, ngram: dict, slopes: dict) -> dict:
    """The run's logged predicted_* metrics, else the speedup model evaluated now."""
    logged = {k: v for k, v in run.data.metrics.items() if k.startswith("predicted_speedup_c")}
    if logged:
        return logged
    replayed = replayed_tokens_per_step(*ngram[run.info.run_id]) if run.info.run_id in ngram else None
    try:
        return predict_run(run.data.metrics, run.data.params, base.data.metrics, tokens_per_step=replayed,
                           b_tok_ms=probe_b_tok(slopes, exclude=run.info.run_id))
    except PredictionUnavailable:
        return {}


def figure(series: list[OptionSeries], title: str):
    from experiments.plots import plt
    workloads = sorted({s.workload for s in series})
    ncols = min(2, len(workloads))
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.8 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    for ax, workload in zip(axes.flat, workloads, strict=False):
        mine = [s for s in series if s.workload == workload]
        levels = sorted({c for s in mine for c in s.points})
        for i, s in enumerate(mine):
            color = colors[i % len(colors)]
            cs = sorted(s.points)
            x = np.array(cs, dtype=float) * (1.0 + 0.04 * (i - (len(mine) - 1) / 2))  # side by side
            y = np.array([s.points[c].speedup for c in cs])
            err = np.array([[y[j] - s.points[c].low for j, c in enumerate(cs)],
                            [s.points[c].high - y[j] for j, c in enumerate(cs)]])
            ax.errorbar(x, y, yerr=np.clip(err, 0, None), fmt="o-", color=color, capsize=4, label=s.label)
            pred = [(xj, s.points[c].predicted) for xj, c in zip(x, cs, strict=True) if s.points[c].predicted]
            if pred:
                ax.plot(*zip(*pred, strict=True), "D", mfc="none", color=color, ms=9,
                        label=f"{s.label} (model)")
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speedup vs baseline (output tok/s)")
        ax.set_title(f"{workload}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: measured (95 % CI) and predicted (hollow diamonds)")
    fig.tight_layout()
    return fig


def html(series: list[OptionSeries], png: bytes, title: str) -> str:
    rows = []
    for s in series:
        for c, p in sorted(s.points.items()):
            pred = "-" if p.predicted is None else f"{p.predicted:.2f}x"
            rows.append(f"<tr><td>{s.label}</td><td>{s.workload}</td><td>{c}</td><td><b>{p.speedup:.2f}x</b></td>"
                        f"<td>[{p.low:.2f}, {p.high:.2f}]</td><td>{p.ci}</td><td>{pred}</td></tr>")
    verdicts = "".join(f"<li><b>{s.label}</b> on {s.workload}: {s.verdict()}</li>" for s in series)
    img = base64.b64encode(png).decode()
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ccc;padding:4px 8px}}
table{{border-collapse:collapse}}</style></head><body><h1>{title}</h1>
<h2>Verdict</h2><ul>{verdicts}</ul><img src="data:image/png;base64,{img}" style="max-width:100%">
<h2>Measurements</h2><table><tr><th>option</th><th>workload</th><th>concurrency</th><th>speedup</th>
<th>95 % CI</th><th>interval from</th><th>model</th></tr>{''.join(rows)}</table>
<p>Pays: the interval lies above 1; does not pay: below 1; inconclusive: it straddles 1.</p></body></html>"""


def _since_ms(text: str) -> int:
    try:
        t = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO time: {text!r} (e.g. 2026-11-30T21:00)") from exc
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp() * 1000)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%MZ")


def main(argv: list[str] | None = None) -> int:
    import mlflow
    from mlflow.tracking import MlflowClient
    from rich.console import Console

    from experiments.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="experiment name or parent (sweep) run id")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    ap.add_argument("--out", type=Path, default=ROOT / "mlruns" / "reports")
    ap.add_argument("--since", type=_since_ms, default=None, metavar="ISO-TIME",
                    help="only runs started at or after this UTC time, e.g. 2026-11-30T21:00 (one session's runs)")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    mlflow.set_tracking_uri(args.tracking_uri)
    client = MlflowClient()
    try:
        options, all_runs, exp_id, parent = select_runs(client, args.target, args.since)
    except ReportInputError as exc:
        console.print(f"[bold red]report refused:[/] {exc}", soft_wrap=True)
        return 2
    title = f"Speculative decoding: {args.target if parent is None else parent.info.run_name or args.target}" + (
        "" if args.since is None else f", runs since {_iso(args.since)}")
    series = build_series(client, options, all_runs)
    fig = figure(series, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.target.replace("/", "_").replace("@", "_") + ("" if args.since is None else
                                                              f"-since-{_iso(args.since).replace(':', '')}")
    png_path, html_path = args.out / f"report-{stem}.png", args.out / f"report-{stem}.html"
    png_path.write_bytes(buf.getvalue())
    html_path.write_text(html(series, buf.getvalue(), title))
    run_id = parent.info.run_id if parent is not None else client.create_run(
        exp_id, tags={"mlflow.runName": f"report-{stem}"[:250], "specws.mode": "report"}).info.run_id
    client.log_artifact(run_id, str(html_path), "report")
    client.log_artifact(run_id, str(png_path), "report")
    client.log_dict(run_id, {f"{s.label} | {s.workload}": {"verdict": s.verdict(), "points": {
        c: vars(p) for c, p in s.points.items()}} for s in series}, "report/verdicts.json")
    if parent is None:
        client.set_terminated(run_id, "FINISHED")
    for s in series:
        console.print(f"[bold]{s.label}[/] on {s.workload}: {s.verdict()}", soft_wrap=True)
    print(html_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
