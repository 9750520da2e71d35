"""The recommendation as Markdown (recommendation.md) and as a section of the decision report's HTML page: the same
tables, every label that came from a run escaped in the HTML."""
from __future__ import annotations

import shlex
from html import escape
from typing import Any

from experiments.engines import ENGINE_NAMES

LOAD_HEAD = ("load", "choice", "status", "speedup [95 % CI]", "prompts", "not separated from", "further prompts",
             "reason")
CANDIDATE_HEAD = ("load", "candidate", "speedup [95 % CI]", "prompts", "goodput ratio [95 % CI]", "breaks SLO")


def _iv(d: dict | None) -> str:
    if not d or d.get("estimate") is None or d["estimate"] != d["estimate"]:
        return "-"
    return f"{d['estimate']:.2f}x [{d['low']:.2f}, {d['high']:.2f}]"


def _goodput(c: dict) -> str:
    slo = c.get("slo") or {}
    if slo.get("goodput_ratio") is None:
        return "-"
    return f"{slo['goodput_ratio']:.2f}x [{slo['goodput_low']:.2f}, {slo['goodput_high']:.2f}]"


def load_rows(rec: dict) -> list[list[str]]:
    return [[d["load"], d["choice"], d["status"], _iv(d["speedup"]) if d["speedup"] else "1 (baseline)",
             str(d["speedup"]["n"]) if d["speedup"] else str(max((c["speedup"]["n"] for c in d["candidates"]),
                                                                  default=0)),
             ", ".join(d["versus"]) or "-", "-" if d["further_prompts"] is None else str(d["further_prompts"]),
             d["reason"]] for d in rec["loads"]]


def candidate_rows(rec: dict) -> list[list[str]]:
    return [[d["load"], c["label"], _iv(c["speedup"]), str(c["speedup"]["n"]), _goodput(c),
             ", ".join(c["breaks_slo"]) or "-"] for d in rec["loads"] for c in d["candidates"]]


def cost_rows(costs: list[dict]) -> tuple[list[str], list[list[str]]]:
    loads = list(costs[0]["loss"]) if costs else []
    rows = [[r["setting"], *(f"{v:+.0%}" if isinstance(v, float) else v for v in r["loss"].values()),
             "-" if r["worst_loss"] is None else f"{r['worst_loss']:+.0%}"] for r in costs]
    return ["one setting", *(f"lost at {ld}" for ld in loads), "worst"], rows


def _md_row(row: list[str] | tuple) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |"


def _md_table(head: list[str] | tuple, rows: list[list[str]]) -> str:
    return "\n".join([_md_row(head), "|" + "---|" * len(head), *map(_md_row, rows)])


def _flag_lines(flags: dict[str, dict]) -> list[str]:
    out = []
    for engine, f in flags.items():
        shown = shlex.join(f["flags"]) if f["flags"] else "(no speculative flags)"
        out.append(f"- {engine}: `{shown}`" + (f" — not passed: {'; '.join(f['not_passed'])}" if f["not_passed"]
                                               else ""))
    return out


def _engine_lines(s: dict[str, Any]) -> list[str]:
    """Per engine, the one deployment that follows the schedule, or why none can."""
    out = []
    for engine in ENGINE_NAMES:
        e = s[engine]
        if e["flags"] is None:
            out.append(f"{engine}: one deployment cannot follow the schedule — {e['why']}")
        else:
            extra = f" with `{e['config_file']}` = `{e['config']}`" if e.get("config") else ""
            out.append(f"{engine}: `{shlex.join(e['flags'])}`{extra} ({e['source']})")
    return out


COSTS = "What one setting for the whole range costs (throughput vs each level's choice, measured):"
NO_SCHEDULE = "One setting for every closed-loop load: no schedule needed."


def _schedule_md(s: dict[str, Any]) -> list[str]:
    if not s.get("needed"):
        return [NO_SCHEDULE]
    return [*(f"- {line}" for line in _engine_lines(s)), "", COSTS, "", _md_table(*cost_rows(s["single_setting"]))]


def _schedule_html(s: dict[str, Any]) -> str:
    if not s.get("needed"):
        return f"<p>{escape(NO_SCHEDULE)}</p>"
    lines = "".join(f"<li>{escape(line)}</li>" for line in _engine_lines(s))
    return f"<ul>{lines}</ul><p>{escape(COSTS)}</p>{_html_table(*cost_rows(s['single_setting']))}"


def _title(rec: dict) -> str:
    ps, w = rec["prompt_set"], rec["workload"]
    return f"{ps} (workload {w})" if ps and ps != w else (ps or w)


def _slo_text(slo: dict) -> str:
    return ", ".join(f"{k.upper()} p99 ≤ {v:g} s" for k, v in slo.items()) or "none set"


def markdown(recs: list, title: str) -> str:
    parts = [f"# {title}", ""]
    for r in (rec.as_dict() for rec in recs):
        parts += [f"## {_title(r)}", "", f"Latency targets: {_slo_text(r['slo'])}", "", f"**{r['summary']}**", "",
                  _md_table(LOAD_HEAD, load_rows(r)), "", "Candidates:", "",
                  _md_table(CANDIDATE_HEAD, candidate_rows(r)), "", "### Flags", ""]
        for label, flags in r["flags"].items():
            parts += [f"**{label}**", "", *_flag_lines(flags), ""]
        parts += ["### Across the closed-loop range", "", *_schedule_md(r["schedule"]), ""]
        parts += [f"Not considered: {k} — {v}" for k, v in r["excluded"].items()]
    return "\n".join(parts) + "\n"


def _html_table(head: list[str] | tuple, rows: list[list[str]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def html_section(recs: list) -> str:
    """The report's Recommendation section: per workload the ranges, the table per load, the candidates, the
    flags of each choice and what one deployment does across the range."""
    out = ["<h2>Recommendation (one answer per load)</h2>"]
    for r in (rec.as_dict() for rec in recs):
        out += [f"<h3>{escape(_title(r))}</h3><p>Latency targets: {escape(_slo_text(r['slo']))}. "
                f"<b>{escape(r['summary'])}</b></p>", _html_table(LOAD_HEAD, load_rows(r)),
                "<p>Candidates</p>", _html_table(CANDIDATE_HEAD, candidate_rows(r)), "<ul>"]
        for label in r["flags"]:
            out += [f"<li><b>{escape(label)}</b>: " + "; ".join(
                f"{escape(engine)} <code>{escape(shlex.join(f['flags']) or '(none)')}</code>"
                for engine, f in r["flags"][label].items()) + "</li>"]
        out += ["</ul><p>Across the closed-loop range</p>", _schedule_html(r["schedule"])]
        out += [f"<p>Not considered: {escape(k)} — {escape(v)}</p>" for k, v in r["excluded"].items()]
    return "".join(out)

