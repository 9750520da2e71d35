"""A forecast made before the option runs, from inputs that exist then: a finished baseline's records, the
acceptance predicted offline on the baseline's outputs (offline_acceptance.py) and the engine's measured step
costs (stepcost.py).

Per baseline request i at level c (n_i tokens, its TTFT and e2e measured, its own time per decode step
s_i = (e2e_i - TTFT_i) / (n_i - 1)), the option would take S_i steps of s_i + x(c, q_i) each, where x is the
profile's excess of a speculative step over a decode step at that concurrency and verify width:

    e2e'_i = TTFT_i + S_i * (s_i + x(c, q_i))        speedup(level) = Σ e2e_i / Σ e2e'_i

(the paired speedup the measurement reports: Σ tokens / Σ e2e of the option over the baseline's, same prompts,
same tokens under greedy decoding). Prefill and queueing (in TTFT) stay as the baseline measured them. The
interval resamples the level's requests and draws the step-cost error from the profile's residual on the runs it
was fitted on, one draw per resample (an error of the profile is common to every request of a level).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from experiments.analysis.runs import RunConfig
from experiments.analysis.speedup.offline_acceptance import RequestSteps, finished
from experiments.analysis.speedup.stepcost import (
    HOST_TOLERANCE,
    MIN_GAPS,
    RegimeCost,
    StepCostProfile,
    chunk_gaps,
    mean_step_ms,
    verify_width,
)
from experiments.analysis.stats import LOSES, PAYS, UNCLEAR

N_BOOT = 2000


class ForecastUnavailable(ValueError):
    """An input the forecast needs is missing; the message names it."""


class HostOutsideProfile(ForecastUnavailable):
    """The baseline ran on a host faster or slower than every host the step-cost profile was fitted on."""


PROBE_HINT = ("probe this host first (step times only, a few prompts per level): bin/probe, or on a lent GPU host "
              "bin/h200 probe; then forecast again")


@dataclass
class LevelForecast:
    concurrency: int
    category: str              # "all" or one category
    speedup: float
    low: float
    high: float
    verdict: str
    tokens_per_step: float
    verified_per_step: float
    regime: str
    requests: int
    baseline_tok_s: float | None = None
    flag: str = ""

    @property
    def output_tok_s(self) -> float | None:
        return None if self.baseline_tok_s is None else self.baseline_tok_s * self.speedup


@dataclass
class Forecast:
    levels: list[LevelForecast] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def overall(self) -> list[LevelForecast]:
        return [f for f in self.levels if f.category == "all"]

    def as_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in self.levels:
            p = "forecast_" if f.category == "all" else f"forecast/{f.category}/"
            out |= {f"{p}speedup_c{f.concurrency}": f.speedup, f"{p}speedup_low_c{f.concurrency}": f.low,
                    f"{p}speedup_high_c{f.concurrency}": f.high}
            if f.category == "all":
                out[f"forecast_tokens_per_step_c{f.concurrency}"] = f.tokens_per_step
                if f.output_tok_s is not None:
                    out[f"forecast_output_tok_s_c{f.concurrency}"] = f.output_tok_s
        return out

    def to_json(self) -> dict:
        return {"notes": self.notes, "levels": [asdict(f) | {"output_tok_s": f.output_tok_s} for f in self.levels]}


def verdict_of(low: float, high: float) -> str:
    return PAYS if low > 1.0 else LOSES if high < 1.0 else UNCLEAR


def verified_per_step(option: RunConfig, steps: RequestSteps) -> float:
    """Tokens verified per sequence and step under the option (see stepcost.verify_width)."""
    width = verify_width(option, steps.drafted_share)
    if width is None:
        raise ForecastUnavailable("the option sets no draft length (spec.num_draft_tokens / num_steps)")
    return width


def level_regime(profile: StepCostProfile, option: RunConfig, c: int) -> tuple[str, RegimeCost, str]:
    """The regime level c runs in under the option's graph limit, its terms (another regime's where that one was
    never probed) and a flag saying so."""
    name, regime = profile.regime(c, option.graph_batch_limit)
    if regime is not None:
        return name, regime, ""
    other = next((n for n in ("graphs", "all", "eager") if n in profile.regimes), None)
    if other is None:
        raise ForecastUnavailable("the step-cost profile has no regime")
    return name, profile.regimes[other], f"c{c}: the {name} regime was never probed, {other}-regime terms used"


def _excess(name: str, regime: RegimeCost, option: RunConfig, c: int, qs: np.ndarray,
            base_step_ms: float | None) -> np.ndarray:
    """Excess step time (s) per request at level c under the level's regime (`name` for the messages)."""
    draft_steps = int(option.spec.num_steps or 0) if option.spec.method == "eagle3" else 0
    values = [regime.excess(option.spec.method, c, float(q), draft_steps) for q in qs]
    if any(v is None for v in values):
        missing = "draft_ms (no EAGLE-3 run probed)" if option.spec.method == "eagle3" else "b_tok_ms"
        raise ForecastUnavailable(f"the step-cost profile lacks {missing} in the {name} regime")
    if regime.unit == "ms":
        unit_ms = 1.0
    elif base_step_ms is None:
        raise ForecastUnavailable(f"c{c}: the baseline streamed too few chunks to measure its decode step")
    else:
        unit_ms = base_step_ms
    return np.asarray(values, float) * unit_ms / 1000.0


def forecast_group(rows: list[dict], steps: list[RequestSteps], option: RunConfig, profile: StepCostProfile,
                   c: int, category: str, base_step_ms: float | None, seed: int = 0) -> LevelForecast:
    n = np.array([len(r["output_token_ids"]) for r in rows], float)
    e2e = np.array([r["e2e_s"] for r in rows], float)
    ttft = np.array([r.get("ttft_s") or 0.0 for r in rows], float)
    s = np.where(n > 1, (e2e - ttft) / np.maximum(n - 1, 1), 0.0)
    big_s = np.array([st.steps for st in steps], float)
    qs = np.array([verified_per_step(option, st) for st in steps], float)
    name, regime, flag = level_regime(profile, option, c)
    x = _excess(name, regime, option, c, qs, base_step_ms)
    ttft = ttft * regime.ttft_ratio.get(option.spec.method, 1.0)
    e2e_opt = ttft + big_s * (s + x)
    estimate = float(e2e.sum() / e2e_opt.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(rows), size=(N_BOOT, len(rows)))
    residual = max(regime.residual_rel, regime.host_residual_rel)
    noise = np.exp(rng.normal(0.0, np.log1p(residual), size=(N_BOOT, 1)))
    boot_opt = ttft[idx] + big_s[idx] * (s[idx] + x[idx]) * noise
    boots = e2e[idx].sum(1) / boot_opt.sum(1)
    lo, hi = (float(v) for v in np.percentile(boots, [2.5, 97.5]))
    decode = np.array([st.decode_tokens for st in steps], float)
    return LevelForecast(c, category, estimate, lo, hi, verdict_of(lo, hi), float(decode.sum() / big_s.sum()),
                         float(qs.mean()), name, len(rows), flag=flag)


def baseline_step_ms(rows: list[dict]) -> float | None:
    """The baseline's decode step at one level (ms) from its streamed chunks; None with too few."""
    gaps = [g for r in rows for g in chunk_gaps(r)]
    return mean_step_ms(np.asarray(gaps)) if len(gaps) >= MIN_GAPS else None


def forecast(base_records: list[dict], base_metrics: dict[str, float], steps: list[RequestSteps],
             option: RunConfig, profile: StepCostProfile, host_band: float | None = HOST_TOLERANCE) -> Forecast:
    """Per level (and category) of the baseline: the option's predicted speedup with an interval. Raises
    HostOutsideProfile where the baseline's decode step lies outside `host_band` times that of every host the
    profile was fitted on (None: never);
    where only some hosts are near this one, their step costs alone are used (the note says which)."""
    rows = finished(base_records)
    if len(rows) != len(steps):
        raise ForecastUnavailable(f"{len(steps)} offline estimates for {len(rows)} baseline requests")
    out = Forecast()
    by_level: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_level.setdefault(int(r.get("concurrency") or 1), []).append(i)
    for c, idx in sorted(by_level.items()):
        step_ms = baseline_step_ms([rows[i] for i in idx])
        level_profile, note = (profile.nearest_hosts(c, step_ms, option.graph_batch_limit, host_band)
                               if host_band is not None and step_ms is not None else (profile, ""))
        if level_profile is None:
            raise HostOutsideProfile(f"{note}; {PROBE_HINT}")
        if note:
            out.notes.append(note)
        groups: dict[str, list[int]] = {}
        for i in idx:
            groups.setdefault(str(rows[i].get("category") or "?"), []).append(i)
        groups = {"all": list(idx)} | ({} if len(groups) == 1 else {f"category {k}" if k == "all" else k: v
                                                                     for k, v in groups.items()})
        for cat, members in groups.items():
            f = forecast_group([rows[i] for i in members], [steps[i] for i in members], option, level_profile, c,
                               cat, step_ms)
            if cat == "all":
                f.baseline_tok_s = base_metrics.get(f"output_tok_s_c{c}")
            out.levels.append(f)
    return out
