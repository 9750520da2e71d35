"""The report's Host section: per option run and level, how it was paired (in time or one after the other), the
server-side step of the option and of its baseline, the spread of the blocks' own speedups, and the flags a run
carries (the host changed state within a level, a step that was bimodal or drifted). Where the runs compared come
from different hosts or leases, what differs between two of them (experiments.analysis.diff).

Reads the runs' tags and metrics (and, for the diff, their artifacts); writes nothing."""
from __future__ import annotations

from html import escape
from typing import Any

from experiments.analysis.report.page import _num

# tags that tell one host (or lease) from another
HOST_KEYS = ("host.cpu_model", "host.gpu", "host.kernel", "specws.host", "host.platform")


def _levels(run) -> list[int]:
    return sorted(int(k.removeprefix("step_p50_ms_c")) for k in run.data.metrics if k.startswith("step_p50_ms_c"))


def host_rows(options: list, by_id: dict[str, Any]) -> list[dict]:
    """One row per option run and level."""
    rows = []
    for run in options:
        tags, m = run.data.tags, run.data.metrics
        base = by_id.get(tags.get("specws.baseline_run_id"))
        bm = base.data.metrics if base is not None else {}
        flags = [f for f in (tags.get("host.state_changed"), tags.get("specws.step_unsteady")) if f and f != "none"]
        for c in _levels(run):
            lo, hi = m.get(f"cat/all/speedup_c{c}_block_min"), m.get(f"cat/all/speedup_c{c}_block_max")
            rows.append({"run": run.info.run_name or run.info.run_id[:8], "timing": tags.get("specws.timing", "-"),
                         "host": _host_label(tags), "c": c, "step": m.get(f"step_p50_ms_c{c}"),
                         "base_step": bm.get(f"step_p50_ms_c{c}"), "excess": m.get(f"step_excess_ms_c{c}"),
                         "blocks": "-" if lo is None else f"{lo:.2f}–{hi:.2f}",
                         "verdict": tags.get(f"specws.verdict_c{c}", "-"),
                         "flags": "; ".join(f for f in flags if f"c{c}" in f) or "-"})
    return rows


def _host_label(tags: dict) -> str:
    parts = [tags.get("host.gpu"), tags.get("host.cpu_model")]
    return ", ".join(p for p in parts if p) or tags.get("specws.host", "not recorded")


def hosts_of(runs: list) -> dict[tuple, list]:
    """Runs grouped by what tells their hosts apart."""
    out: dict[tuple, list] = {}
    for run in runs:
        out.setdefault(tuple(run.data.tags.get(k) for k in HOST_KEYS), []).append(run)
    return out


def cross_host_diff(client, options: list) -> str:
    """Where the option runs come from more than one host: the diff of a run of each of the first two hosts, of one
    configuration where both hosts ran it."""
    groups = list(hosts_of(options).values())
    if len(groups) < 2:
        return ""
    from experiments.analysis.diff import diff_runs, render
    from experiments.analysis.report.inputs import config_key
    same = [(x, y) for x in groups[0] for y in groups[1] if config_key(x) == config_key(y)]
    first, second = same[0] if same else (groups[0][0], groups[1][0])   # the same configuration where there is one
    a, b = first.info.run_id, second.info.run_id
    try:
        diffs, fa, fb = diff_runs(client, a, b)
    except Exception as exc:  # noqa: BLE001 - the report goes on without it, saying why
        return f"(the diff of {a[:8]} and {b[:8]} could not be made: {type(exc).__name__}: {exc})"
    return render(diffs, fa, fb)


def html_section(client, options: list, all_runs: list) -> str:
    """The Host section's HTML; empty where no run has server-side steps (runs older than the host record)."""
    rows = host_rows(options, {r.info.run_id: r for r in all_runs})
    if not rows:
        return ""
    cells = "".join("<tr>" + "".join(f"<td>{escape(str(x))}</td>" for x in (
        r["run"], r["timing"], r["host"], r["c"], _num(r["step"]), _num(r["base_step"]), _num(r["excess"]),
        r["blocks"], r["verdict"], r["flags"])) + "</tr>" for r in rows)
    diff = cross_host_diff(client, options)
    diff_html = "" if not diff else (
        f"<h3>These runs come from more than one host: what differs</h3><pre>{escape(diff)}</pre>")
    return ("<h2>Host</h2><table><tr><th>run</th><th>paired</th><th>host</th><th>concurrency</th>"
            "<th>step p50 (ms)</th><th>baseline step p50 (ms)</th><th>excess (ms)</th><th>blocks' own speedups</th>"
            f"<th>verdict</th><th>flags</th></tr>{cells}</table>"
            "<p>Paired: <i>interleaved</i> — option and baseline up together, each block of first-seen prompts sent to "
            "one and then the other (ABBA); <i>sequential</i> — the baseline measured before the option. Step: the "
            "server's decode step per request (SGLang's own clock; vLLM's streamed chunks), its median over the "
            "level. Blocks' own speedups: the lowest and highest block; where one block decided <i>pays</i> and "
            "another <i>does not pay</i> the verdict is <i>host-sensitive</i>. Flags: the host's calibration probe "
            "swung by more than 25 % within the level (its numbers straddle two host states), or the step was "
            "bimodal or drifted within it.</p>" + diff_html)
