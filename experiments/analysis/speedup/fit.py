"""The speedup model against a store: the verification-cost probes (vLLM: single-stream n-gram records
against their replay; SGLang: each run's step time over its paired baseline's vs tokens verified per step, across
the experiment's runs; used for engines that verify a fixed number of tokens per step), the inputs the post-run
prediction (experiments/analysis/predict.py) takes from the store, and the predicted-vs-measured table over every
measured run (`python -m experiments.analysis.speedup.cli table`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from experiments.analysis.replay import (
    NgramIndex,
    ReplayInputError,
    engine_config,
    load_source,
    replay_config,
    replay_workload,
)
from experiments.analysis.runs import RunConfig, run_config
from experiments.analysis.speedup.model import (
    PredictionUnavailable,
    baseline_profile,
    draft_length,
    levels_of,
    predict_run,
)
from experiments.analysis.speedup.stepcost import mean_step_ms, nonneg_lstsq
from experiments.tracking.records import run_records

PAUSE_SHARE = 0.10   # a level whose longest pause is this share of its wall time is flagged (warm-up stall)


def probe_slopes(runs: dict[str, tuple[list, object]]) -> dict[str, float]:
    """Verification-cost probe: ms per extra verified token, per run, from single-stream n-gram records
    whose streamed chunks line up one-to-one with the replayed engine steps (step time = t0 + slope *
    draft tokens verified; fitted per run because machine speed drifts between runs)."""
    slopes = {}
    for run_id, (seqs, cfg) in runs.items():
        singles = [s for s in seqs if s.concurrency == 1 and s.chunk_times_s]
        if not singles:
            continue
        x, y = [], []
        for seq, st in zip(singles, replay_config(NgramIndex(singles, cfg.max_match), cfg, keep_emitted=True),
                           strict=True):
            if st.emitted == seq.chunk_tokens:
                x += st.verified
                y += np.diff(seq.chunk_times_s).tolist()
        if len(set(x)) > 1 and len(x) > 20:
            slopes[run_id] = float(np.polyfit(np.asarray(x, float), 1000.0 * np.asarray(y), 1)[0])
    return slopes


def probe_b_tok(slopes: dict[str, float], exclude: str | None = None) -> float | None:
    """Median slope over the probed runs (leaving out the run being predicted), never below 0."""
    values = [v for k, v in slopes.items() if k != exclude]
    return float(max(0.0, np.median(values))) if values else None


# ---------------------------------------------------------------- fixed-width verification-cost probe (SGLang)

@dataclass
class StepPoint:
    """One SGLang run: engine step time per concurrency level and the tokens it verifies per step."""
    run_id: str
    method: str          # none | ngram | eagle3
    verified: float      # tokens verified per sequence and step (baseline 1, SGLang speculation num_draft_tokens)
    draft_steps: int     # draft-model forwards per step (EAGLE-3 num_steps, else 0)
    step_ms: dict[int, float]                                 # per level: mean step time (pauses included)
    max_c: int | None = None                                  # CUDA-graph batch limit it ran with
    pauses: dict[int, float] = field(default_factory=dict)   # per level: longest TTFT or chunk gap, s
    base_step_ms: dict[int, float] = field(default_factory=dict)  # its paired baseline's step time per level

    def excess(self) -> list[tuple[int, float]]:
        """(c, step time over the paired baseline's at c) on the CUDA-graph levels both ran."""
        return [(c, ms - self.base_step_ms[c]) for c, ms in self.step_ms.items()
                if c in self.base_step_ms and (self.max_c is None or c <= self.max_c)]


@dataclass
class VerifyFit:
    """Step time of a speculative run over its own paired baseline's at the same concurrency (so hosts and leases
    whose speed differs compare): excess(c, q) = spec_overhead + spec_overhead_seq * c + b_tok * c * (q - 1),
    fitted over the experiment's SGLang NGRAM runs at every CUDA-graph level. Columns the runs cannot tell apart are
    dropped: the per-sequence overhead needs two concurrencies, the fixed one two draft lengths (else b_tok
    carries it)."""
    spec_overhead_ms: float
    spec_overhead_seq_ms: float
    b_tok_ms: float
    runs: list[str]
    points: list[tuple[int, float]]     # (c, q) of the points fitted

    def excess_ms(self, c: float, q: float) -> float:
        if q <= 1:
            return 0.0
        return self.spec_overhead_ms + self.spec_overhead_seq_ms * c + self.b_tok_ms * c * (q - 1)


@dataclass
class EagleCost:
    """What an EAGLE-3 step costs over its baseline's beyond verifying its tokens (b_tok from the NGRAM fit):
    overhead + overhead_seq * c + draft_ms * draft steps, fitted over the experiment's other EAGLE-3 runs where
    they tell the terms apart (own = True), else NGRAM's overhead and a median draft cost."""
    overhead_ms: float
    overhead_seq_ms: float
    draft_ms: float
    own: bool


def sglang_step_points(client, runs) -> dict[str, StepPoint]:
    """Step time of every finished run with records of an engine that verifies a fixed number of tokens per step
    (SGLang), per concurrency level, from the streamed chunk intervals (the first chunk is the prefill's token;
    SGLang streams one chunk per decode/verify step), with its paired baseline's step times where that baseline
    is among `runs`."""
    out, paired = {}, {}
    for run in runs:
        config = run_config(run)
        if not config.fixed_verify_width:
            continue
        method = config.spec.method
        verified = 1.0 if method == "none" else config.verified_per_step
        if verified is None:
            continue
        gaps: dict[int, list] = {}
        pauses: dict[int, float] = {}
        for r in run_records(client, run.info.run_id) or []:
            c, t = r.get("concurrency"), r.get("chunk_times_s") or []
            if not c or r.get("error"):
                continue
            intervals = [b - a for a, b in zip(t, t[1:], strict=False)]
            gaps.setdefault(c, []).extend(intervals)
            pauses[c] = max(pauses.get(c, 0.0), r.get("ttft_s") or 0.0, *intervals)
        steps = {c: mean_step_ms(np.asarray(g)) for c, g in gaps.items() if len(g) >= 20}
        if steps:
            draft_steps = (config.spec.num_steps or 0) if method == "eagle3" else 0
            out[run.info.run_id] = StepPoint(run.info.run_id, method, verified, draft_steps, steps,
                                             config.graph_batch_limit, pauses)
            paired[run.info.run_id] = run.data.tags.get("specws.baseline_run_id")
    for run_id, p in out.items():
        base = out.get(paired[run_id] or "")
        if p.method != "none" and base is not None and base.method == "none":
            p.base_step_ms = dict(base.step_ms)
    return out


def fit_verify_cost(points: dict[str, StepPoint], exclude: str | None = None) -> VerifyFit | None:
    """The SGLang probe over the NGRAM runs paired with a baseline, leaving out the run being predicted."""
    use = [p for k, p in points.items() if k != exclude and p.method == "ngram" and p.excess()]
    rows = [(c, p.verified, ms) for p in use for c, ms in p.excess()]
    if not rows:
        return None
    c, q, y = (np.array(v, dtype=float) for v in zip(*rows, strict=True))
    cols = {"over": np.ones_like(c), "over_seq": c, "b_tok": c * (q - 1)}
    coef = nonneg_lstsq(cols, y, [[], ["over_seq"], ["over"], ["over", "over_seq"]])
    if coef is None:
        return None
    return VerifyFit(coef["over"], coef["over_seq"], coef["b_tok"], [p.run_id for p in use],
                     sorted({(int(a), float(b)) for a, b in zip(c, q, strict=True)}))


def fit_eagle_cost(points: dict[str, StepPoint], fit: VerifyFit, exclude: str | None = None) -> EagleCost | None:
    """EAGLE-3's own step overhead from the experiment's other EAGLE-3 runs (see EagleCost); None without one."""
    use = [p for k, p in points.items() if k != exclude and p.method == "eagle3" and p.draft_steps and p.excess()]
    rows = [(c, p.draft_steps, ms - fit.b_tok_ms * c * (p.verified - 1)) for p in use for c, ms in p.excess()]
    if not rows:
        return None
    c, d, y = (np.array(v, dtype=float) for v in zip(*rows, strict=True))
    coef = nonneg_lstsq({"over": np.ones_like(c), "over_seq": c, "draft": d}, y, [[], ["over_seq"], ["draft"],
                                                                                   ["over_seq", "draft"]])
    if coef is not None and len(set(zip(c, d, strict=True))) > 1:
        return EagleCost(coef["over"], coef["over_seq"], coef["draft"], True)
    draft = np.median((y - fit.spec_overhead_ms - fit.spec_overhead_seq_ms * c) / d)
    return EagleCost(fit.spec_overhead_ms, fit.spec_overhead_seq_ms, float(max(0.0, draft)), False)


def sglang_inputs(points: dict[str, StepPoint], run_id: str, config: RunConfig,
                  base_metrics: dict[str, float]) -> tuple[dict, str]:
    """predict_run keyword arguments for a fixed-width (SGLang) run from the probe (leave-one-out) and a note."""
    max_c = config.graph_batch_limit
    kw: dict = {"profile_max_c": max_c}
    fit = fit_verify_cost(points, exclude=run_id)
    if fit is None:
        return kw, ("verification cost: no SGLang probe (needs NGRAM runs paired with a baseline), "
                    "b_tok = b_seq")
    kw |= {"b_tok_ms": fit.b_tok_ms, "spec_overhead_ms": fit.spec_overhead_ms,
           "spec_overhead_seq_ms": fit.spec_overhead_seq_ms}
    note = (f"verification cost: SGLang probe over {len(fit.runs)} runs, (c, q) = {fit.points}: step time over the "
            f"paired baseline's = {fit.spec_overhead_ms:.3g} + {fit.spec_overhead_seq_ms:.3g} c + "
            f"{fit.b_tok_ms:.3g} c (q - 1) ms")
    if config.spec.method == "eagle3":
        eagle = fit_eagle_cost(points, fit, exclude=run_id)
        if eagle is not None:
            t11 = baseline_profile(base_metrics, max_c=max_c).step_ms(1, 1.0)
            kw |= {"spec_overhead_ms": eagle.overhead_ms, "spec_overhead_seq_ms": eagle.overhead_seq_ms,
                   "draft_step_cost": eagle.draft_ms / t11}
            note += (f"; EAGLE-3 ({'its own fit over' if eagle.own else 'NGRAM overhead, draft from'} the other "
                     f"EAGLE-3 runs): {eagle.overhead_ms:.3g} + {eagle.overhead_seq_ms:.3g} c ms, "
                     f"{eagle.draft_ms:.3g} ms per draft step")
    if max_c:
        note += f"; baseline profile from levels <= {max_c} (CUDA-graph limit)"
    return kw, note


def level_flags(run, base_run, points: dict[str, StepPoint], c: int) -> str:
    """Why a level's measurement is outside what the model describes ('' when nothing is known)."""
    flags = []
    max_c = run_config(run).graph_batch_limit
    if max_c is not None and c > max_c:
        flags.append(f"c{c} > --cuda-graph-max-bs-decode {max_c}: eager decode, profile fitted on CUDA-graph levels")
    for r, who in ((run, "option"), (base_run, "baseline")):
        p = points.get(r.info.run_id)
        wall = r.data.metrics.get(f"wall_s_c{c}")
        if p and wall and p.pauses.get(c, 0.0) >= PAUSE_SHARE * wall:
            flags.append(f"{who} paused {p.pauses[c]:.2f} s ({100 * p.pauses[c] / wall:.0f} % of the level's "
                         f"{wall:.2f} s wall; first-batch warm-up on a fresh server)")
    return "; ".join(flags)


def error_table(client, experiment: str, use_replay: bool = True, use_probe: bool = True,
                log: bool = False) -> list[dict]:
    """One row per (speculative run, concurrency) with its baseline in the store; `log` also writes the
    predicted_* metrics onto runs measured before the model existed (or refreshes them)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise PredictionUnavailable(f"no experiment {experiment!r}")
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED' and tags.`specws.mode` = 'measure'",
                              max_results=2000)
    by_id = {r.info.run_id: r for r in runs}
    ngram = ngram_sources(client, runs)
    slopes = probe_slopes(ngram) if use_probe else {}
    points = sglang_step_points(client, runs)
    rows = []
    for run in runs:
        config = run_config(run)
        if not config.spec.speculative or config.baseline_run_id not in by_id:
            continue
        base = by_id[config.baseline_run_id]
        replayed = replayed_tokens_per_step(*ngram[run.info.run_id]) if use_replay and run.info.run_id in ngram \
            else None
        if config.fixed_verify_width:
            kw, cost_note = sglang_inputs(points if use_probe else {}, run.info.run_id, config, base.data.metrics)
        else:
            b_tok = probe_b_tok(slopes, exclude=run.info.run_id)
            kw = {"b_tok_ms": b_tok}
            cost_note = f"verification cost: {'b_tok = b_seq' if b_tok is None else f'probe {b_tok:.3g} ms/token'}"
        try:
            pred = predict_run(run.data.metrics, config, base.data.metrics, tokens_per_step=replayed, **kw)
        except PredictionUnavailable as exc:
            rows.append({"run": run.info.run_id, "error": str(exc)})
            continue
        source = "replay" if replayed else "engine counters"
        if log:
            _backfill(client, run.info.run_id, pred, f"speedup_model table --log; acceptance: {source}; {cost_note}")
        inputs = {"acceptance_source": source, "b_tok_ms": kw.get("b_tok_ms"),
                  "spec_overhead_ms": kw.get("spec_overhead_ms", 0.0), "draft_step_cost": kw.get("draft_step_cost"),
                  "note": cost_note}
        rows += _level_rows(run, config, base, pred, points, inputs)
    return rows


def _backfill(client, run_id: str, predicted: dict[str, float], note: str) -> None:
    import mlflow
    now = int(time.time() * 1000)   # newer than the values logged at measure time: MLflow shows the latest
    client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, float(v), now, 0) for k, v in predicted.items()])
    client.set_tag(run_id, "specws.prediction", note)


def _level_rows(run, config: RunConfig, base, pred: dict[str, float], points: dict[str, StepPoint],
                inputs: dict) -> list[dict]:
    """The table's rows of one run: predicted against measured tok/s at each level both have."""
    rows = []
    for c in levels_of(run.data.metrics):
        if f"predicted_output_tok_s_c{c}" not in pred:
            continue
        measured, predicted = run.data.metrics[f"output_tok_s_c{c}"], pred[f"predicted_output_tok_s_c{c}"]
        rows.append({"run": run.info.run_id, "option": config.option, "workload": config.workload,
                     "method": config.spec.method, "k": draft_length(config.spec)[1], "concurrency": c, **inputs,
                     "flag": level_flags(run, base, points, c),
                     "tokens_per_step": pred[f"predicted_tokens_per_step_c{c}"],
                     "baseline_tok_s": base.data.metrics[f"output_tok_s_c{c}"],
                     "measured_tok_s": measured, "predicted_tok_s": predicted,
                     "rel_error": abs(predicted - measured) / measured})
    return rows


def ngram_sources(client, runs) -> dict[str, tuple[list, object]]:
    """Recorded sequences and served configuration of every run with records whose n-gram drafter the replay
    reproduces exactly (vLLM's prompt lookup)."""
    out = {}
    for run in runs:
        served = engine_config(run)
        if served is None:
            continue
        try:
            out[run.info.run_id] = (load_source(run.info.run_id, client).sequences, served[0])
        except ReplayInputError:
            continue
    return out


def replayed_tokens_per_step(seqs: list, cfg) -> dict[int, tuple[float, float]]:
    """Exact (tokens per decode step, share of steps with a draft) per level, by replaying the records."""
    levels = replay_workload(seqs, [cfg])[cfg]["levels"]
    return {c: (s.metrics()["tokens_per_step"], s.metrics()["steps_with_draft"]) for c, s in levels.items()}
