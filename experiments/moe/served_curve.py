"""The served expert-growth curve and the per-step cost table, from `experiments/moe/h200_serve.py`'s results.

    python -m experiments.moe.served_curve DIR [--curve-out FILE [--experts E --top-k K]]

DIR holds what one H200 run wrote: `decode.json`, `ngram.json`, `graphs.json` (a phase not run is skipped, and
the output says so; a phase cut short, `"complete": false`, is used as far as it got and marked partial).

Telemetry keys are SGLang's forward-mode names, lowercased by `sglang_patches/expert_telemetry.py`: `decode`
(one token per sequence), `target_verify` (a speculative verify forward, bs * (k+1) tokens for NGRAM chain
drafts) and `extend` (prefill); each also as `<mode>@tokens=<n>@bs=<b>`.
"""
from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

PHASES = ("decode", "ngram", "graphs")
DECODE, VERIFY = "decode", "target_verify"
KEY = re.compile(r"^(?P<mode>[a-z_0-9]+)@tokens=(?P<tokens>\d+)@bs=(?P<bs>\d+)$")


def load_phase(served_dir: Path | str, phase: str) -> dict | None:
    """`<served_dir>/<phase>.json`, or None when the phase did not run (no file)."""
    path = Path(served_dir) / f"{phase}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def is_partial(result: dict) -> bool:
    """Whether the phase stopped before its end (`complete` false; results written before the flag count as
    complete)."""
    return result.get("complete", True) is False


def unbudgeted(configs_or_passes: list[dict]) -> int | None:
    """The unbudgeted B: the largest budget (h200_serve's first, the number of experts) among those tagged."""
    budgets = [x["budget"] for x in configs_or_passes if x.get("budget") is not None]
    return max(budgets) if budgets else None


def telemetry_keys(passes: list[dict]) -> Iterator[tuple[dict, str, int, int, dict]]:
    """(pass, mode, tokens per forward, batch size, summary) of every `<mode>@tokens=..@bs=..` telemetry key."""
    for p in passes:
        for key, summary in (p.get("telemetry") or {}).items():
            m = KEY.match(key)
            if m:
                yield p, m["mode"], int(m["tokens"]), int(m["bs"]), summary


def telemetry_points(passes: list[dict], mode: str) -> list[tuple[int, float, int]]:
    """(tokens per forward, mean distinct experts per MoE layer, forwards) of every `<mode>@tokens=..` key."""
    return [(tokens, float(s["mean_distinct"]), int(s["forwards"]))
            for _, m, tokens, _, s in telemetry_keys(passes) if m == mode and s.get("forwards")]


def curve_points(served_dir: Path | str) -> list[tuple[int, float, int]]:
    """Measured (tokens, distinct experts, forwards), one per token count, sorted: decode forwards of
    decode.json and unbudgeted verify forwards of ngram.json, the same token count averaged weighted by
    forwards."""
    points = []
    decode = load_phase(served_dir, "decode")
    if decode:
        points += telemetry_points(decode.get("passes", []), DECODE)
    ngram = load_phase(served_dir, "ngram")
    if ngram:
        passes = [p for c in ngram.get("configs", []) for p in c.get("passes", [])]
        full = unbudgeted(passes)
        points += telemetry_points([p for p in passes if p.get("budget") == full], VERIFY)
    merged: dict[int, list[float]] = {}
    for tokens, distinct, forwards in points:
        acc = merged.setdefault(tokens, [0.0, 0])
        acc[0] += distinct * forwards
        acc[1] += forwards
    return [(t, s / f, int(f)) for t, (s, f) in sorted(merged.items())]


def expert_curve(served_dir: Path | str) -> list[float]:
    """Distinct routed experts per MoE layer at 1, 2, ... N tokens in one forward (N: the largest measured), the
    `BoxProfile.expert_curve` list: linear interpolation between measured token counts (below the smallest one,
    held at its value, as `load_expert_curve` does). Empty when nothing was measured."""
    points = curve_points(served_dir)
    if not points:
        return []
    tokens, distinct = [p[0] for p in points], [p[1] for p in points]
    return [float(v) for v in np.interp(np.arange(1, tokens[-1] + 1), tokens, distinct)]


def curve_json(served_dir: Path | str, experts: int | None = None, top_k: int | None = None) -> dict:
    """The curve file `experiments.analysis.speedup.model.load_expert_curve` reads (its telemetry form):
    `growth` (the measured points, which it interpolates to the same `curve`), `num_experts`/`top_k` when
    given (so that it carries the curve over to another MoE by the ratio to uniform routing), `curve` itself."""
    if (experts is None) != (top_k is None):
        raise ValueError("give both experts and top_k, or neither")
    out: dict = {"source": str(served_dir),
                 "growth": [{"tokens_per_step": t, "mean_distinct": d, "forwards": f}
                            for t, d, f in curve_points(served_dir)],
                 "curve": expert_curve(served_dir)}
    if experts is not None:
        out.update(num_experts=experts, top_k=top_k)
    return out


def pass_row(phase: str, k: int, budget: int | None, p: dict, partial: bool) -> dict:
    c, wall = p["concurrency"], p["wall_s"]
    steps = p["output_tokens"] / c if phase == "decode" else \
        sum(q.get("spec_verify_ct") or 0 for q in p.get("requests", [])) / c
    tel = (p.get("telemetry") or {}).get(DECODE if phase == "decode" else VERIFY) or {}
    return {"phase": phase, "k": k, "budget": budget, "concurrency": c, "tok_s": p["tok_s"],
            "steps_s": steps / wall if steps else None, "step_ms": 1000 * wall / steps if steps else None,
            "accept_length": 1.0 if phase == "decode" else p.get("accept_length_tokens_per_verify"),
            "distinct": tel.get("mean_distinct"), "step_ms_ratio": None, "tok_s_ratio": None, "partial": partial}


def step_table(served_dir: Path | str) -> list[dict]:
    """One row per (phase, k, budget, concurrency) pass: tok/s, engine steps per second per sequence, mean step
    ms, accept length (tokens per verify; 1 for decode), distinct experts per MoE layer of the pass's decode /
    verify forwards (None without telemetry: graphs), and for budgeted rows `step_ms_ratio`/`tok_s_ratio` to the
    unbudgeted row at the same phase, k and concurrency.

    Steps are counted per sequence: sum(spec_verify_ct) over the requests (output tokens for decode, one token
    a step) divided by the concurrency, so steps/s = that / wall_s and step ms = wall_s * concurrency / steps.
    An approximation: it assumes the batch stays full (every step carries `concurrency` sequences), which the
    ramp-up and the tail of a pass break. Phases without a file are skipped (see `missing_phases`)."""
    rows: list[dict] = []
    full: dict[str, int | None] = {}   # per phase, the unbudgeted B the budgeted rows are compared with
    decode = load_phase(served_dir, "decode")
    if decode:
        rows += [pass_row("decode", 0, None, p, is_partial(decode)) for p in decode.get("passes", [])]
    ngram = load_phase(served_dir, "ngram")
    if ngram:
        full["ngram"] = unbudgeted([p for c in ngram.get("configs", []) for p in c.get("passes", [])])
        rows += [pass_row("ngram", cfg["k"], p.get("budget"), p, is_partial(ngram))
                 for cfg in ngram.get("configs", []) for p in cfg.get("passes", [])]
    graphs = load_phase(served_dir, "graphs")
    if graphs:
        full["graphs"] = unbudgeted(graphs.get("configs", []))
        rows += [pass_row("graphs", graphs.get("k"), cfg["budget"], p, is_partial(graphs))
                 for cfg in graphs.get("configs", []) for p in cfg.get("passes", [])]
    index = {(r["phase"], r["k"], r["budget"], r["concurrency"]): r for r in rows}
    for r in rows:
        ref = index.get((r["phase"], r["k"], full.get(r["phase"]), r["concurrency"]))
        if r["budget"] is None or ref is None or ref is r:
            continue
        if ref["step_ms"] and r["step_ms"]:
            r["step_ms_ratio"] = r["step_ms"] / ref["step_ms"]
        if ref["tok_s"]:
            r["tok_s_ratio"] = r["tok_s"] / ref["tok_s"]
    return rows


def missing_phases(served_dir: Path | str) -> list[str]:
    return [ph for ph in PHASES if not (Path(served_dir) / f"{ph}.json").is_file()]


def phase_notes(served_dir: Path | str) -> list[str]:
    """One line per phase not run, cut short, or with a server that failed."""
    notes = [f"{ph}: not run (no {ph}.json), skipped" for ph in missing_phases(served_dir)]
    for ph in PHASES:
        result = load_phase(served_dir, ph)
        if result is None:
            continue
        if is_partial(result):
            notes.append(f"{ph}: partial (complete: false), rows marked *")
        for cfg in [result, *result.get("configs", [])]:
            if cfg.get("error"):
                label = ", ".join(f"{x}={cfg[x]}" for x in ("k", "budget") if x in cfg)
                notes.append(f"{ph}{f' ({label})' if label else ''}: server failed: {cfg['error'][:200]}")
    return notes


def _fmt(v: object, digits: int = 2) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(rows: list[dict]) -> str:
    head = ["phase", "k", "B", "c", "tok/s", "steps/s", "step ms", "accept", "distinct", "step ms / B=all",
            "tok/s / B=all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["phase"] + ("*" if r["partial"] else ""), r["k"], r["budget"], r["concurrency"],
                 _fmt(r["tok_s"], 1), _fmt(r["steps_s"], 1), _fmt(r["step_ms"]), _fmt(r["accept_length"]),
                 _fmt(r["distinct"]), _fmt(r["step_ms_ratio"], 3), _fmt(r["tok_s_ratio"], 3)]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("served_dir", type=Path, help="the folder h200_serve wrote (decode/ngram/graphs.json)")
    p.add_argument("--curve-out", type=Path, help="write the expert curve JSON (load_expert_curve reads it)")
    p.add_argument("--experts", type=int, help="routed experts of the served model (with --top-k)")
    p.add_argument("--top-k", type=int, help="experts per token of the served model (with --experts)")
    a = p.parse_args(argv)
    if (a.experts is None) != (a.top_k is None):
        p.error("--experts and --top-k go together")
    if len(missing_phases(a.served_dir)) == len(PHASES):
        p.error(f"{a.served_dir}: none of {', '.join(f'{ph}.json' for ph in PHASES)}")
    for note in phase_notes(a.served_dir):
        print(f"note: {note}")
    print(markdown(step_table(a.served_dir)))
    points = curve_points(a.served_dir)
    print("\nexpert curve (tokens: distinct): " + ", ".join(f"{t}: {d:.2f}" for t, d, _ in points))
    if a.curve_out:
        data = curve_json(a.served_dir, a.experts, a.top_k)
        a.curve_out.write_text(json.dumps(data, indent=1))
        print(f"wrote {a.curve_out} ({len(data['curve'])} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
