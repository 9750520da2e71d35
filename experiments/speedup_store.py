"""The speedup model against a store: the verification-cost probe from single-stream n-gram records, the
prediction logged by experiments/measure.py for a run being measured, and the predicted-vs-measured table
over every measured run (`python -m experiments.speedup_model table`)."""
from __future__ import annotations

import numpy as np

from experiments.speedup_model import PredictionUnavailable, draft_length, levels_of, predict_run


def probe_slopes(runs: dict[str, tuple[list, object]]) -> dict[str, float]:
    """Verification-cost probe: ms per extra verified token, per run, from single-stream n-gram records
    whose streamed chunks line up one-to-one with the replayed engine steps (step time = t0 + slope *
    draft tokens verified; fitted per run because machine speed drifts between runs)."""
    from experiments.replay import NgramIndex, replay_config
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
    rows = []
    for run in runs:
        base_id = run.data.tags.get("specws.baseline_run_id")
        if run.data.params.get("spec.method", "none") == "none" or base_id not in by_id:
            continue
        replayed = replayed_tokens_per_step(*ngram[run.info.run_id]) if use_replay and run.info.run_id in ngram \
            else None
        b_tok = probe_b_tok(slopes, exclude=run.info.run_id)
        try:
            pred = predict_run(run.data.metrics, run.data.params, by_id[base_id].data.metrics,
                               tokens_per_step=replayed, b_tok_ms=b_tok)
        except PredictionUnavailable as exc:
            rows.append({"run": run.info.run_id, "error": str(exc)})
            continue
        if log:
            import mlflow
            client.log_batch(run.info.run_id, metrics=[mlflow.entities.Metric(k, float(v), 0, 0)
                                                       for k, v in pred.items()])
            client.set_tag(run.info.run_id, "specws.prediction",
                           f"speedup_model table --log; acceptance: {'replay' if replayed else 'engine counters'}; "
                           f"verification cost: {'b_tok = b_seq' if b_tok is None else f'probe {b_tok:.3g} ms/token'}")
        for c in levels_of(run.data.metrics):
            if f"predicted_output_tok_s_c{c}" in pred:
                measured = run.data.metrics[f"output_tok_s_c{c}"]
                predicted = pred[f"predicted_output_tok_s_c{c}"]
                rows.append({"run": run.info.run_id, "option": run.data.tags.get("specws.option"),
                             "workload": run.data.tags.get("specws.workload"), "method": run.data.params["spec.method"],
                             "k": draft_length(run.data.params)[1], "concurrency": c,
                             "acceptance_source": "replay" if replayed else "engine counters",
                             "b_tok_ms": b_tok,
                             "tokens_per_step": pred[f"predicted_tokens_per_step_c{c}"],
                             "baseline_tok_s": by_id[base_id].data.metrics[f"output_tok_s_c{c}"],
                             "measured_tok_s": measured, "predicted_tok_s": predicted,
                             "rel_error": abs(predicted - measured) / measured})
    return rows


def ngram_sources(client, runs) -> dict[str, tuple[list, object]]:
    """Recorded sequences and served configuration of every vLLM n-gram run that has records."""
    from experiments.replay import ReplayInputError, engine_config, load_source
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
    from experiments.replay import replay_workload
    levels = replay_workload(seqs, [cfg])[cfg]["levels"]
    return {c: (s.metrics()["tokens_per_step"], s.metrics()["steps_with_draft"]) for c, s in levels.items()}


def predict_live(client, experiment_id: str, run_id: str, option: dict[str, float], params: dict[str, str],
                 base: dict[str, float], drafts_by_level: dict[int, float], records: list[dict]) -> tuple[dict, str]:
    """`predicted_*` metrics for a run being measured (experiments/measure.py) and a note on the inputs:
    acceptance replayed from its records where the engine is vLLM n-gram, else its counters; verification
    cost probed on the store's other single-stream n-gram runs of this experiment (the 6 newest)."""
    from experiments.replay import NgramConfig, ReplayInputError, sequences_from_records
    notes = []
    tokens_per_step = None
    if params.get("spec.method") == "ngram" and params.get("engine.name") == "vllm":
        try:
            cfg = NgramConfig(int(params["spec.ngram.min_match"]), int(params["spec.ngram.max_match"]),
                              int(params["spec.num_draft_tokens"]))
            tokens_per_step = replayed_tokens_per_step(sequences_from_records(records, run_id), cfg)
            notes.append("acceptance: replay of the records")
        except (ReplayInputError, KeyError, ValueError) as exc:
            notes.append(f"acceptance: engine counters (no replay: {exc})")
    runs = client.search_runs([experiment_id], "attributes.status = 'FINISHED' and params.`spec.method` = 'ngram'"
                              " and tags.`specws.mode` = 'measure'", max_results=6,
                              order_by=["attributes.start_time DESC"])
    b_tok = probe_b_tok(probe_slopes(ngram_sources(client, [r for r in runs if r.info.run_id != run_id])))
    notes.append("verification cost: " + ("no probe, b_tok = b_seq" if b_tok is None
                                          else f"probe {b_tok:.3g} ms/token"))
    return predict_run(option, params, base, drafts_by_level, tokens_per_step, b_tok_ms=b_tok), "; ".join(notes)


