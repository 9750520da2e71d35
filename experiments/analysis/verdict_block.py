"""The verdict block: what a measured run decided, written last — on the console and as the run's MLflow
description (`mlflow.note.content`, markdown, first line `Verdict: ...`) — from what the post-run analysis logged
on it: per level the paired speedup with its 95 % interval (`cat/all/speedup_c<c>[_low|_high]`, categories.py), the
level's verdict (`specws.verdict_c<c>`, slo.py) and its prompts (`cat/all/prompts_c<c>`); the greedy check in words;
the sample size, with a warning when it is too small to decide on; the forecast made before the run
(`forecast_speedup_c<c>`, forecast/runs.py); the commands that look further. The same per level as metrics that sort
first: `decision_speedup_c<c>[_low|_high]` and `decision_verdict_c<c>` (+1 pays, 0 undecided, -1 does not pay).

A sweep's child also rewrites its parent's description over the children measured so far (`sweep_verdict`)."""
from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from experiments.analysis.runs import run_config
from experiments.analysis.slo import BREAKS_SLO, CONTAMINATED
from experiments.analysis.speedup.forecast import verdict_of
from experiments.analysis.stats import LOSES, PAYS
from experiments.analysis.words import MIN_PROMPTS, few_prompts, levels_words, option_words
from experiments.config.paths import ROOT
from experiments.harness.sweep import swept_param as sweep_varying
from experiments.tracking.redact import redact_text

NOTE_TAG = "mlflow.note.content"
PARENT_TAG = "mlflow.parentRunId"
DEFAULT_URI = f"sqlite:///{ROOT / 'mlruns/mlflow.db'}"
SCORES = {PAYS: 1.0, LOSES: -1.0, BREAKS_SLO: -1.0}   # any other verdict: 0 (inconclusive, host-sensitive, ...)
WORDS = {BREAKS_SLO: "breaks a latency target", CONTAMINATED: "contaminated (no verdict)"}
console = Console(stderr=True, soft_wrap=True, highlight=False)


@dataclass(frozen=True)
class Level:
    """One concurrency level as the post-run analysis logged it."""
    c: int
    speedup: float | None
    low: float | None
    high: float | None
    verdict: str | None
    prompts: int | None
    output_tok_s: float | None = None
    forecast: tuple[float, float, float] | None = None
    covered: bool | None = None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _levels_named(names: Iterable[str], pattern: str) -> set[int]:
    return {int(m.group(1)) for name in names if (m := re.fullmatch(pattern, name))}


def levels_of(run: Any) -> list[Level]:
    """The run's levels: those with a verdict tag, a paired speedup or (a baseline) an output rate."""
    m, t = run.data.metrics, run.data.tags
    cs = (_levels_named(t, r"specws\.verdict_c(\d+)") | _levels_named(m, r"cat/all/speedup_c(\d+)")
          | _levels_named(m, r"output_tok_s_c(\d+)"))
    return [_level(c, m, t) for c in sorted(cs)]


def _level(c: int, m: dict[str, float], t: dict[str, str]) -> Level:
    speedup = _num(m.get(f"cat/all/speedup_c{c}", m.get(f"speedup_vs_baseline_c{c}")))
    prompts = _num(m.get(f"cat/all/prompts_c{c}")) or None   # 0: no paired prompt (no baseline)
    f = [_num(m.get(f"forecast_speedup{part}_c{c}")) for part in ("", "_low", "_high")]
    covered = _num(m.get(f"forecast_covered_c{c}"))
    return Level(c, speedup, _num(m.get(f"cat/all/speedup_c{c}_low")), _num(m.get(f"cat/all/speedup_c{c}_high")),
                 t.get(f"specws.verdict_c{c}"), None if prompts is None else int(prompts),
                 _num(m.get(f"output_tok_s_c{c}")), tuple(f) if None not in f else None,
                 None if covered is None else covered > 0.5)


def decision_metrics(levels: list[Level]) -> dict[str, float]:
    """decision_speedup_c<c>[_low|_high] and decision_verdict_c<c> (+1 pays, 0 undecided, -1 does not pay)."""
    out: dict[str, float] = {}
    for lv in levels:
        for name, value in (("speedup", lv.speedup), ("speedup_low", lv.low), ("speedup_high", lv.high)):
            if value is not None and lv.verdict is not None:
                out[f"decision_{name}_c{lv.c}"] = value
        if lv.verdict is not None:
            out[f"decision_verdict_c{lv.c}"] = SCORES.get(lv.verdict, 0.0)
    return out


def option_label(run: Any) -> str:
    """`A (n-gram, 4 draft tokens)`, `C (EAGLE-3, 3 steps)`, `baseline (no speculation)` (analysis/words.py)."""
    config = run_config(run)
    return f"{run.data.tags.get('specws.option', '?')} ({option_words(None, config.spec, config.engine)})"


def _said(verdict: str) -> str:
    return WORDS.get(verdict, verdict)


def summary(levels: list[Level]) -> str:
    """`pays at c=1 and 4`, `pays at c=1; inconclusive at c=4`."""
    groups: dict[str, list[int]] = {}
    for lv in levels:
        if lv.verdict is not None:
            groups.setdefault(lv.verdict, []).append(lv.c)
    return "; ".join(f"{_said(v)} at {levels_words(cs, 'c=')}" for v, cs in groups.items())


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _interval(low: float | None, high: float | None) -> str:
    return "[-]" if low is None or high is None else f"[{low:.2f}, {high:.2f}]"


def level_line(lv: Level) -> str:
    prompts = f" ({lv.prompts} prompts)" if lv.prompts is not None else ""
    if lv.verdict is None:
        rate = "-" if lv.output_tok_s is None else f"{lv.output_tok_s:.1f}"
        return f"- c={lv.c}: {rate} tok/s, speedup {_x(lv.speedup)}, no verdict{prompts}"
    return (f"- c={lv.c}: speedup {_x(lv.speedup)}, 95 % interval {_interval(lv.low, lv.high)}: "
            f"**{_said(lv.verdict)}**{prompts}")


def lossless_line(m: dict[str, float]) -> str | None:
    """The greedy agreement with the baseline in words (or the distribution check at temperature > 0)."""
    compared = _num(m.get("greedy_compared"))
    if compared:
        n, near, real = int(compared), int(m.get("greedy_near_ties", 0)), int(m.get("greedy_real_divergences", 0))
        if real:
            return (f"- **not lossless**: {real} of {n} outputs diverge from the baseline's beyond a near tie "
                    f"(greedy_check.json){f'; {near} more only at near ties' if near else ''}")
        if near:
            return (f"- lossless: 0 real divergences; {near} of {n} outputs differ from the baseline's only at near "
                    "ties (top-2 log-probabilities within bf16 rounding)")
        return f"- lossless: all {n} outputs identical to the baseline's (greedy)"
    if (tv := _num(m.get("sampled_token_tv"))) is not None:
        noise, p = _num(m.get("sampled_token_tv_noise")), _num(m.get("sampled_length_ks_p"))
        return (f"- sampled outputs (temperature > 0): token-frequency distance {tv:.3f} to the baseline's, "
                f"{'-' if noise is None else f'{noise:.3f}'} between the baseline's own halves; output lengths "
                f"KS p = {'-' if p is None else f'{p:.2f}'}")
    return None


def sample_line(levels: list[Level], workload: str) -> str | None:
    """The prompts per level, and a warning when fewer than MIN_PROMPTS decide a level (analysis/words.py)."""
    counts = sorted({lv.prompts for lv in levels if lv.prompts is not None})
    if not counts:
        return None
    warning = few_prompts(workload, counts[0])
    if warning:
        return f"- **sample**: {warning}"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"- sample: {n} prompts per level (at least {MIN_PROMPTS})"


def forecast_line(levels: list[Level], run_id: str | None) -> str | None:
    made = [lv for lv in levels if lv.forecast is not None]
    if not made:
        return None
    parts = []
    for lv in made:
        est, low, high = lv.forecast
        said = verdict_of(low, high)
        held = "" if lv.covered is None else (", the measurement inside its interval" if lv.covered
                                             else ", the measurement outside its interval")
        parts.append(f"c={lv.c} {est:.2f}x {_interval(low, high)} {said}{held}")
    return f"- forecast made before the run{f' ({run_id})' if run_id else ''}: {'; '.join(parts)}"


def notes(run: Any) -> list[str]:
    """What else a reader must know before trusting the numbers."""
    t, out = run.data.tags, []
    if t.get("specws.post_run_failed"):
        out.append(f"- the post-run analysis failed: {t['specws.post_run_failed'][:300]}")
    if any(v == CONTAMINATED for k, v in t.items() if k.startswith("specws.verdict_c")):
        out.append(f"- contamination check: {t.get('specws.contamination', '?')[:300]}")
    if t.get("specws.host_loaded") == "true":
        out.append("- other processes kept the host busy while it measured (specws.host_loaded)")
    return out


def store_of(client: Any) -> tuple[str | None, str | None]:
    """(tracking URI, offline folder) of the client, credentials masked."""
    uri = getattr(client, "tracking_uri", None)
    root = getattr(client, "root", None)
    return (redact_text(str(uri)) if uri else None), (str(root) if root and not uri else None)


def next_commands(client: Any, target: str, run_id: str) -> list[str]:
    """The report, the UI and the recommendation, for this store."""
    uri, offline = store_of(client)
    if offline:
        return [f"- `.venv/bin/python -m experiments.tracking.import_runs {shlex.quote(offline)}` — into a store, "
                "then the report, the UI and the recommendation there"]
    given = "" if uri in (None, DEFAULT_URI) else f" --tracking-uri {shlex.quote(uri)}"
    if uri in (None, DEFAULT_URI):
        ui = "`bin/ui`"
    elif uri.startswith(("http://", "https://")):
        ui = f"{uri} in a browser"
    else:
        ui = f"`.venv/bin/mlflow ui --workers 1 --backend-store-uri {shlex.quote(uri)}`"
    t = shlex.quote(target)
    return [f"- `.venv/bin/python -m experiments.analysis.report {t}{given}` — the decision report (HTML)",
            f"- {ui} — the MLflow UI (this run: {run_id})",
            f"- `.venv/bin/python -m experiments.analysis.recommend --experiment {t}{given}` — one answer per load"]


def experiment_name(client: Any, run: Any) -> str:
    try:
        return client.get_experiment(run.info.experiment_id).name
    except Exception:  # noqa: BLE001 - the offline store names its experiment by its id
        return str(run.info.experiment_id)


def run_block(client: Any, run: Any, levels: list[Level]) -> str:
    """The run's verdict block as markdown; its first line starts with `Verdict:`."""
    m, t = run.data.metrics, run.data.tags
    label, workload = option_label(run), t.get("specws.workload", "?")
    if t.get("specws.spec_method", run.data.params.get("spec.method", "none")) == "none":
        rates = [f"{lv.output_tok_s:.1f} tok/s at c={lv.c}" for lv in levels if lv.output_tok_s is not None]
        head = f"Verdict: {label} on {workload} — the reference options are paired with: {', '.join(rates) or '-'}"
        body = []
    else:
        said = summary(levels) or ("not paired with a baseline: no verdict" if "specws.baseline_run_id" not in t
                                   else "no verdict (see below)")
        head = f"Verdict: {label} on {workload} — {said}"
        body = [level_line(lv) for lv in levels]
        body += [x for x in (lossless_line(m), forecast_line(levels, t.get("specws.forecast_run_id"))) if x]
    body += [x for x in (sample_line(levels, workload),) if x] + notes(run)
    commands = next_commands(client, experiment_name(client, run), run.info.run_id)
    return "\n".join([head, "", *body, "", "Next:", "", *commands])


def show(markdown: str) -> None:
    """The block on the console: the headline bold, code marks dropped."""
    head, _, rest = markdown.partition("\n")
    console.print()
    console.print(head, style="bold", markup=False)
    for line in rest.splitlines():
        if line:
            console.print("  " + line.replace("`", "").replace("**", ""), markup=False)


def log_verdict_block(client: Any, run_id: str, baseline: Any, engine: str) -> None:
    """Post-run processor, last: the decision_* metrics, the run's description, the block on the console (not for a
    baseline paired in time with an option: the option's block follows), and a sweep parent's description."""
    run = client.get_run(run_id)
    levels = levels_of(run)
    for key, value in decision_metrics(levels).items():
        client.log_metric(run_id, key, value)
    block = run_block(client, run, levels)
    client.set_tag(run_id, NOTE_TAG, block)
    if "specws.paired_option_run_id" not in run.data.tags:
        show(block)
    parent = run.data.tags.get(PARENT_TAG)
    if parent:
        try:
            sweep_verdict(client, parent, shown=False)
        except Exception as exc:  # noqa: BLE001 - the child's own block stands
            console.print(f"[yellow]the sweep parent's description was not updated[/]: {exc}")


# ---------------------------------------------------------------- a sweep's parent

def swept_param(params: list[dict[str, str]], overrides: str = "") -> str | None:
    """The parameter that differs between children (the sweep's own rule), else the first swept override."""
    varying = sweep_varying(params)
    if varying:
        return varying
    swept = [o.split("=", 1)[0].lstrip("+~") for o in overrides.split() if "," in o.partition("=")[2]]
    return swept[0] if swept else None


def sweep_block(client: Any, parent: Any, children: list[Any]) -> str:
    """A sweep parent's verdict block: per child its levels, the best child per level, the next commands."""
    t = parent.data.tags
    param = swept_param([r.data.params for r in children], t.get("specws.sweep_overrides", ""))
    rows = sorted(((r, levels_of(r)) for r in children), key=lambda x: str(x[0].data.params.get(param or "", "")))
    workload = next((r.data.tags.get("specws.workload") for r in children), "?")
    best = []
    for c in sorted({lv.c for _, lvs in rows for lv in lvs}):
        at = [(lv, r) for r, lvs in rows for lv in lvs if lv.c == c and lv.speedup is not None]
        if at:
            lv, r = max(at, key=lambda x: x[0].speedup)
            best.append(f"best at c={c}: {param}={r.data.params.get(param or '', '?')} {_x(lv.speedup)} "
                        f"{_interval(lv.low, lv.high)} {_said(lv.verdict or '-')}")
    head = (f"Verdict: sweep of {t.get('specws.option', '?')} over {param or '?'} on {workload} — "
            f"{'; '.join(best) or 'no child measured yet'}")
    body = [f"- {param}={r.data.params.get(param or '', '?')}: " + "; ".join(
        f"c={lv.c} {_x(lv.speedup)} {_interval(lv.low, lv.high)} {_said(lv.verdict or '-')}" for lv in lvs)
        + f" ({r.info.run_id})" for r, lvs in rows]
    sample = sample_line([lv for _, lvs in rows for lv in lvs], workload)
    body += [sample] if sample else []
    return "\n".join([head, "", f"{len(children)} measured children:", "", *body, "", "Next:", "",
                      *next_commands(client, parent.info.run_id, parent.info.run_id)])


def sweep_verdict(client: Any, parent_id: str, shown: bool = True) -> str:
    """Write the sweep parent's description over its measured children (an option's, not a baseline's), and show it
    unless `shown` is False; returns the markdown. For the sweep's end: `sweep_verdict(client, parent_id)`."""
    parent = client.get_run(parent_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_id}'")
    measured = [r for r in children if r.data.tags.get("specws.mode") == "measure"
                and r.data.tags.get("specws.spec_method", "none") != "none"]
    block = sweep_block(client, parent, measured)
    client.set_tag(parent_id, NOTE_TAG, block)
    if shown:
        show(block)
    return block
