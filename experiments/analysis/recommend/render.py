"""The recommendation as Markdown (recommendation.md) and as a section of the decision report's HTML page: the same
tables, every configuration in words (experiments.analysis.words), every label that came from a run escaped in the
HTML, column help under the tables, a warning where a level rests on too few prompts, and an engine's caveat only
for a setting someone chose (not the option's or the measured engine's default), saying what to do."""
from __future__ import annotations

import re
import shlex
from html import escape
from typing import Any

from experiments.analysis.words import few_prompts, set_by_default, workload_words
from experiments.engines import ENGINE_NAMES

LOAD_HEAD = ("load", "choice", "status", "speedup [95 % CI]", "prompts", "not separated from", "further prompts",
             "reason")
CANDIDATE_HEAD = ("load", "candidate", "speedup [95 % CI]", "prompts", "goodput ratio [95 % CI]", "breaks SLO")
HELP = {"status": "decided: the data separate the choice from the baseline and every other candidate; "
                  "inconclusive: not yet",
        "not separated from": "the candidates (or no speculation) that the paired intervals cannot yet tell apart "
                              "from the choice",
        "further prompts": "about how many more prompts per level would tell them apart, if the estimates held",
        "goodput ratio [95 % CI]": "requests per second within every latency target, the option's over the "
                                   "baseline's"}
NOT_PASSED = re.compile(r"^spec\.(?P<knob>[\w.]+)=(?P<value>[^:]*): (?P<why>.*)$", re.S)
RUN_ADVICE = re.compile(r";\s*remove it or use engine=\w+\s*$")


def _iv(d: dict | None) -> str:
    if not d or d.get("estimate") is None or d["estimate"] != d["estimate"]:
        return "-"
    return f"{d['estimate']:.2f}x [{d['low']:.2f}, {d['high']:.2f}]"


def _goodput(c: dict) -> str:
    slo = c.get("slo") or {}
    if slo.get("goodput_ratio") is None:
        return "-"
    return f"{slo['goodput_ratio']:.2f}x [{slo['goodput_low']:.2f}, {slo['goodput_high']:.2f}]"


def _prompts(d: dict) -> int:
    return d["speedup"]["n"] if d["speedup"] else max((c["speedup"]["n"] for c in d["candidates"]), default=0)


def load_rows(rec: dict) -> list[list[str]]:
    return [[d["load"], d["choice_words"], d["status"], _iv(d["speedup"]) if d["speedup"] else "1 (baseline)",
             str(_prompts(d)), "; ".join(d["versus_words"]) or "-",
             "-" if d["further_prompts"] is None else str(d["further_prompts"]), d["reason"]] for d in rec["loads"]]


def candidate_rows(rec: dict) -> list[list[str]]:
    return [[d["load"], c["words"], _iv(c["speedup"]), str(c["speedup"]["n"]), _goodput(c),
             ", ".join(c["breaks_slo"]) or "-"] for d in rec["loads"] for c in d["candidates"]]


def _candidates(rec: dict) -> dict[str, dict]:
    """label -> a candidate of that label (its words, option and the engine it was measured on)."""
    return {c["label"]: c for d in rec["loads"] for c in d["candidates"]}


def _words(rec: dict, label: str) -> str:
    return _candidates(rec).get(label, {}).get("words", label)


def cost_rows(costs: list[dict], rec: dict | None = None) -> tuple[list[str], list[list[str]]]:
    loads = list(costs[0]["loss"]) if costs else []
    rows = [[_words(rec or {"loads": []}, r["setting"]),
             *(f"{v:+.0%}" if isinstance(v, float) else v for v in r["loss"].values()),
             "-" if r["worst_loss"] is None else f"{r['worst_loss']:+.0%}"] for r in costs]
    return ["one setting", *(f"lost at {ld}" for ld in loads), "worst"], rows


def caveats(not_passed: list[str], engine: str, candidate: dict | None) -> list[str]:
    """An engine's reasons for leaving settings out, kept only for a setting someone chose (the option's and the
    measured engine's defaults are nobody's to remove), each saying what to do with it."""
    out = []
    for reason in not_passed:
        m = NOT_PASSED.match(reason)
        if m is None or candidate is None:
            out.append(reason)
            continue
        measured = candidate.get("engine")
        if set_by_default(candidate.get("option"), measured, m["knob"], m["value"]):
            continue
        why = RUN_ADVICE.sub("", m["why"])
        todo = ("it had no effect when measured: leave it out" if engine == measured else
                f"deploy this choice on {measured}, where it was measured with it, or measure it on {engine} "
                "without it")
        out.append(f"spec.{m['knob']}={m['value']} (your setting): {why} — {todo}")
    return out


def warnings(rec: dict) -> list[str]:
    """The few-prompts warning for a workload whose levels rest on fewer than words.MIN_PROMPTS prompts."""
    counts = [n for n in map(_prompts, rec["loads"]) if n]
    found = few_prompts(rec["workload"], min(counts)) if counts else None
    return [found] if found else []


def legend(head: list[str] | tuple) -> str:
    """One line of column help for the columns of `head` that have some."""
    return "; ".join(f"{h}: {HELP[h]}" for h in head if h in HELP)


def _md_row(row: list[str] | tuple) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |"


def _md_table(head: list[str] | tuple, rows: list[list[str]]) -> str:
    return "\n".join([_md_row(head), "|" + "---|" * len(head), *map(_md_row, rows)])


def _flag_lines(flags: dict[str, dict], candidate: dict | None) -> list[str]:
    out = []
    for engine, f in flags.items():
        shown = shlex.join(f["flags"]) if f["flags"] else "(no speculative flags)"
        notes = caveats(f["not_passed"], engine, candidate)
        out.append(f"- {engine}: `{shown}`" + (f" — not passed: {'; '.join(notes)}" if notes else ""))
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


def _schedule_md(s: dict[str, Any], rec: dict) -> list[str]:
    if not s.get("needed"):
        return [NO_SCHEDULE]
    return [*(f"- {line}" for line in _engine_lines(s)), "", COSTS, "",
            _md_table(*cost_rows(s["single_setting"], rec))]


def _schedule_html(s: dict[str, Any], rec: dict) -> str:
    if not s.get("needed"):
        return f"<p>{escape(NO_SCHEDULE)}</p>"
    lines = "".join(f"<li>{escape(line)}</li>" for line in _engine_lines(s))
    return f"<ul>{lines}</ul><p>{escape(COSTS)}</p>{_html_table(*cost_rows(s['single_setting'], rec))}"


def _title(rec: dict) -> str:
    return workload_words(rec["workload"], rec["prompt_set"])


def _slo_text(slo: dict) -> str:
    return ", ".join(f"{k.upper()} p99 ≤ {v:g} s" for k, v in slo.items()) or "none set"


def _md_section(r: dict) -> list[str]:
    found = _candidates(r)
    parts = [f"## {_title(r)}", "", *(f"**Warning**: {w}" for w in warnings(r)), "",
             f"Latency targets: {_slo_text(r['slo'])}", "", f"**{r['summary']}**", "",
             _md_table(LOAD_HEAD, load_rows(r)), "", legend(LOAD_HEAD), "", "Candidates:", "",
             _md_table(CANDIDATE_HEAD, candidate_rows(r)), "", legend(CANDIDATE_HEAD), "", "### Flags", ""]
    for label, flags in r["flags"].items():
        parts += [f"**{_words(r, label)}**", "", *_flag_lines(flags, found.get(label)), ""]
    parts += ["### Across the closed-loop range", "", *_schedule_md(r["schedule"], r), ""]
    return parts + [f"Not considered: {k} — {v}" for k, v in r["excluded"].items()]


def markdown(recs: list, title: str) -> str:
    parts = [f"# {title}", ""]
    for rec in recs:
        parts += _md_section(rec.as_dict())
    return "\n".join(parts) + "\n"


def _html_table(head: list[str] | tuple, rows: list[list[str]]) -> str:
    th = "".join(f'<th title="{escape(HELP[h])}">{escape(h)}</th>' if h in HELP else f"<th>{escape(h)}</th>"
                 for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    note = f"<p><small>{escape(legend(head))}</small></p>" if legend(head) else ""
    return f"<table><tr>{th}</tr>{body}</table>{note}"


def _flags_html(r: dict) -> str:
    found, items = _candidates(r), []
    for label, engines in r["flags"].items():
        shown = []
        for engine, f in engines.items():
            notes = caveats(f["not_passed"], engine, found.get(label))
            shown.append(f"{escape(engine)} <code>{escape(shlex.join(f['flags']) or '(none)')}</code>"
                         + (f" (not passed: {escape('; '.join(notes))})" if notes else ""))
        items.append(f"<li><b>{escape(_words(r, label))}</b>: " + "; ".join(shown) + "</li>")
    return f"<ul>{''.join(items)}</ul>"


def html_section(recs: list) -> str:
    """The report's Recommendation section: per workload the ranges, the table per load, the candidates, the
    flags of each choice and what one deployment does across the range."""
    out = ["<h2>Recommendation (one answer per load)</h2>"]
    for r in (rec.as_dict() for rec in recs):
        out += [f"<h3>{escape(r['workload'])}</h3>",
                *(f'<p class="warn"><b>Warning</b>: {escape(w)}</p>' for w in warnings(r)),
                f"<p>Latency targets: {escape(_slo_text(r['slo']))}. <b>{escape(r['summary'])}</b></p>",
                _html_table(LOAD_HEAD, load_rows(r)), "<p>Candidates</p>", _html_table(CANDIDATE_HEAD,
                                                                                        candidate_rows(r)),
                _flags_html(r), "<p>Across the closed-loop range</p>", _schedule_html(r["schedule"], r)]
        out += [f"<p>Not considered: {escape(k)} — {escape(v)}</p>" for k, v in r["excluded"].items()]
    return "".join(out)
