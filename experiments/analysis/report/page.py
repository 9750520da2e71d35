"""The decision report as one self-contained HTML page; every label that came from a run is escaped."""
from __future__ import annotations

import base64
from html import escape
from typing import Any

from experiments.analysis.report.figure import panel_titles

STYLE = ("body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px 8px}"
         "table{border-collapse:collapse}.bad{color:#b00}"
         ".warn{background:#fff3cd;border:1px solid #e0b000;padding:6px 10px}"
         "th[title]{text-decoration:underline dotted}")


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or value != value else fmt.format(value)


def _cells(*values: Any) -> str:
    return "".join(f"<td>{escape(str(v))}</td>" for v in values)


def _forecast(p: Any) -> tuple[str, str]:
    """(forecast [95 % interval], forecast error) of a report.Point; "-" where no forecast was made."""
    if p.forecast is None:
        return "-", "-"
    return (f"{_num(p.forecast, '{:.2f}x')} [{_num(p.forecast_low)}, {_num(p.forecast_high)}]",
            _num(None if p.forecast_error is None else 100.0 * p.forecast_error, "{:+.1f} %"))


def _slo(p: Any) -> str:
    """The latency targets at a point: the ones it breaks (missed where the baseline meets them), else met, with
    the goodput ratio and its paired interval; "-" without targets."""
    if not p.slo:
        return "-"
    g = p.slo
    ratio = "" if g.get("goodput_ratio") is None else (
        f"; goodput {g['goodput_ratio']:.2f}x [{g['goodput_low']:.2f}, {g['goodput_high']:.2f}]")
    return (f"breaks {', '.join(p.slo['breaks'])}" if p.slo["breaks"] else "met") + ratio


def _point_rows(series: list) -> str:
    rows = []
    for s in series:
        flag = "contaminated" if s.contaminated else "clean" if s.contamination else "-"
        for c, p in sorted(s.points.items()):
            rows.append(f"<tr>{_cells(s.label, s.workload, c)}<td><b>{_num(p.speedup, '{:.2f}x')}</b></td>"
                        f"{_cells(f'[{_num(p.low)}, {_num(p.high)}]', p.verdict, p.ci, _num(p.logged, '{:.2f}x'))}"
                        f"{_cells(p.to_decide if p.to_decide is not None else '-', *_forecast(p))}"
                        f"{_cells(_num(p.predicted, '{:.2f}x'), _slo(p))}"
                        f"<td class=\"{'bad' if s.contaminated else ''}\">{escape(flag)}</td></tr>")
    return "".join(rows)


def _category_rows(series: list) -> str:
    rows = []
    for s in series:
        verdict_of = "contaminated — not a verdict" if s.contaminated else None
        for r in s.categories:
            rows.append("<tr>" + _cells(
                s.label, s.workload, r["concurrency"], r["category"], r["n_prompts"],
                _num(r["speedup"], "{:.2f}x"), f"[{_num(r['speedup_low'])}, {_num(r['speedup_high'])}]",
                verdict_of or r["verdict"], r["prompts_to_decide"] if r["prompts_to_decide"] is not None else "-",
                _num(r["accept_length"]),
                " / ".join(f"{p:.2f}" for p in r["accept_per_position"][:8]) or "-") + "</tr>")
    return "".join(rows)


def _contamination_rows(series: list) -> str:
    return "".join(f"<tr>{_cells(s.label, s.workload, run, tag)}</tr>"
                   for s in series for run, tag in sorted(s.contamination.items()))


def page(series: list, png: bytes, title: str, recommendation: str = "", pareto: bytes | None = None,
         telemetry: str = "", host: str = "") -> str:
    """`series`: report.OptionSeries (label, workload, points, categories, contamination, verdict());
    `recommendation`: the Recommendation section's HTML (experiments/analysis/recommend/render.py); `pareto`: the
    throughput vs per-user speed figure; `telemetry`: the Telemetry section's HTML
    (experiments/analysis/report/telemetry.py); `host`: the Host section's (experiments/analysis/report/host.py)."""
    where = panel_titles(series)     # the workload, with its prompt set once, here
    verdicts = "".join(f"<li><b>{escape(s.label)}</b> on {escape(where[s.workload])}: {escape(s.verdict())}</li>"
                       for s in series)
    warnings = "".join(f'<p class="warn"><b>Warning</b>: {escape(s.label)} on {escape(s.workload)}: '
                       f"{escape(s.warning())}</p>" for s in series if s.warning())
    img = base64.b64encode(png).decode()
    frontier = "" if pareto is None else (
        "<h2>Throughput against per-user speed</h2><p>Every setting and load; the frontier ringed: no other point has "
        "at least its aggregate tok/s and its per-user rate (TPOT).</p>"
        f'<img src="data:image/png;base64,{base64.b64encode(pareto).decode()}" style="max-width:100%">')
    head = ("<tr><th>option</th><th>workload</th><th>concurrency</th><th>speedup</th><th>95 % CI</th>"
            "<th>verdict</th><th>interval from</th><th>run metric</th><th>prompts to decide</th>"
            "<th>forecast [95 % interval]</th><th>forecast error</th><th>post-hoc model</th><th>latency targets</th>"
            "<th>contamination</th></tr>")
    cat_head = ("<tr><th>option</th><th>workload</th><th>concurrency</th><th>category</th><th>prompts</th>"
                "<th>speedup</th><th>95 % CI</th><th>verdict</th><th>prompts to decide</th><th>accept length</th>"
                "<th>P(position accepted)</th></tr>")
    t = escape(title)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{t}</title><style>{STYLE}</style></head>
<body><h1>{t}</h1><h2>Verdict</h2><ul>{verdicts}</ul>{warnings}
<img src="data:image/png;base64,{img}" style="max-width:100%">
{recommendation}{frontier}
<h2>Measurements</h2><table>{head}{_point_rows(series)}</table>
<p>Speedup: (Σ output tokens / Σ request seconds) of the option over the baseline's, on the prompts both served;
interval: paired bootstrap over those prompts (where a level has several blocks: over blocks, then prompts within
them; host-sensitive: blocks decided opposite ways, see Host). Run metric: the runs' logged wall-clock tok/s ratio.
Pays: the interval lies above 1; does not pay: below 1; inconclusive: it straddles 1 (prompts to decide: about
how many prompts would settle it if the estimate held).
Forecast: the prediction made before the option ran (<code>run.forecast=true</code>: the baseline's outputs, the
option's acceptance on them offline, the engine's step-cost profile), the mean over the configuration's runs that
carry one; forecast error: forecast / measured speedup − 1, against the speedup of this table; "-": no forecast
was made. Post-hoc model: the speedup model evaluated after the run with the run's own measured acceptance (not a
forecast). The verdict names every level where the forecast's verdict (from its interval) is not the measured
one. Latency targets (<code>workload.slo</code>): "breaks" names a target whose p99 the option misses where the
baseline meets it, and the level's verdict is then breaks_slo whatever its throughput; goodput: requests per second
within every target, the option's over the baseline's on the same prompts.</p>
{host}{telemetry}
<h2>Per category</h2><table>{cat_head}{_category_rows(series)}</table>
<p>A level whose prompts all belong to one category shows its "all" row only.</p>
<h2>Contamination (acceptance that depends on what the engine served before)</h2>
<table><tr><th>option</th><th>workload</th><th>run</th><th>check</th></tr>{_contamination_rows(series)}</table>
<p>A configuration with a flagged run gets no verdict: its acceptance measured the engine's memory of earlier
requests (a prompt sent again, or a cache filling up within a level), not the drafter.</p></body></html>"""
