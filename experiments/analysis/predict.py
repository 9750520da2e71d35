"""Post-run processor: the speedup model's prediction for a measured speculative run, logged beside its
measurements as `predicted_*` metrics, with the `specws.prediction` tag saying which inputs it used (or why
there is no prediction). It reads what the measurement stored -- the run's metrics (per level: tok/s, tokens,
chunks, `spec_drafts_c<c>`, accept length), its records and config, the baseline's metrics -- and never fails
the run.

Inputs: acceptance replayed from the run's records where the replay reproduces the engine's n-gram drafter,
else the engine's counters; verification cost probed on the experiment's other runs (engines that verify a fixed
number of tokens per step: every finished run's step times; others: the 6 newest n-gram runs' single-stream
records against their replay)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from experiments.analysis.replay import NgramConfig, ReplayInputError, sequences_from_records
from experiments.analysis.runs import RunConfig, run_config
from experiments.analysis.speedup.fit import (
    ngram_sources,
    probe_b_tok,
    probe_slopes,
    replayed_tokens_per_step,
    sglang_inputs,
    sglang_step_points,
)
from experiments.analysis.speedup.model import levels_of, predict_run
from experiments.tracking.store import Metric

if TYPE_CHECKING:
    from mlflow.entities import Run

TAG = "specws.prediction"
PROBE_RUNS = 6
MEASURED = "attributes.status = 'FINISHED' and tags.`specws.mode` = 'measure'"


def log_prediction(client: Any, run_id: str, baseline: Run | None, records: list[dict]) -> dict[str, float]:
    """Log the prediction for `run_id` against `baseline` (nothing for a run without speculation); returns the
    `predicted_*` metrics logged."""
    try:
        run = client.get_run(run_id)
        config = run_config(run)
        if not config.spec.speculative:
            return {}
        if baseline is None:
            client.set_tag(run_id, TAG, "not predicted: no paired baseline")
            return {}
        predicted, note = predict_measured(client, run, config, baseline.data.metrics, records)
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in predicted.items()])
        client.set_tag(run_id, TAG, note[:5000])
        return predicted
    except Exception as exc:  # noqa: BLE001 - the measurement stands without its prediction
        client.set_tag(run_id, TAG, f"not predicted: {type(exc).__name__}: {exc}"[:5000])
        return {}


def drafts_per_level(metrics: dict[str, float]) -> dict[int, float]:
    """The engine's drafted steps at each concurrency level, as the measurement logged them."""
    return {c: metrics[f"spec_drafts_c{c}"] for c in levels_of(metrics) if f"spec_drafts_c{c}" in metrics}


def predict_measured(client: Any, run: Any, config: RunConfig, base: dict[str, float],
                     records: list[dict]) -> tuple[dict[str, float], str]:
    """`predicted_*` metrics of a measured run against its baseline's metrics, and a note on the inputs."""
    tokens_per_step, acceptance_note = replayed_acceptance(config, records, run.info.run_id)
    kw, cost_note = verification_cost(client, run, config, base)
    notes = [n for n in (acceptance_note, cost_note) if n]
    metrics = run.data.metrics
    return predict_run(metrics, config, base, drafts_per_level(metrics), tokens_per_step, **kw), "; ".join(notes)


def replayed_acceptance(config: RunConfig, records: list[dict],
                        run_id: str) -> tuple[dict[int, tuple[float, float]] | None, str]:
    """(tokens per step, draft share) per level replayed from the records where the replay reproduces the
    engine's n-gram drafter exactly, and a note ('' when the run has no such drafter)."""
    try:
        window = config.ngram_window()
        if window is None or not window.exact:
            return None, ""
        ngram = NgramConfig(window.min_match, window.max_match, window.k)
        replayed = replayed_tokens_per_step(sequences_from_records(records, run_id), ngram)
    except (ReplayInputError, ValueError) as exc:
        return None, f"acceptance: engine counters (no replay: {exc})"
    return replayed, "acceptance: replay of the records"


def verification_cost(client: Any, run: Any, config: RunConfig, base: dict[str, float]) -> tuple[dict, str]:
    """predict_run keyword arguments for the cost of verifying more tokens per step, probed on the
    experiment's other runs, and a note."""
    run_id, experiment_id = run.info.run_id, run.info.experiment_id
    if config.fixed_verify_width:
        # every finished run of the experiment on such an engine (baselines, n-gram of any length, EAGLE-3)
        runs = client.search_runs([experiment_id], MEASURED, max_results=2000)
        points = sglang_step_points(client, [r for r in runs if r.info.run_id != run_id])
        return sglang_inputs(points, run_id, config, base)
    runs = client.search_runs([experiment_id], f"{MEASURED} and params.`spec.method` = 'ngram'",
                              max_results=PROBE_RUNS, order_by=["attributes.start_time DESC"])
    b_tok = probe_b_tok(probe_slopes(ngram_sources(client, [r for r in runs if r.info.run_id != run_id])))
    return {"b_tok_ms": b_tok}, "verification cost: " + ("no probe, b_tok = b_seq" if b_tok is None
                                                         else f"probe {b_tok:.3g} ms/token")
