"""Offline n-gram (prompt-lookup) replay: the acceptance vLLM's n-gram speculation would get on recorded
greedy outputs, for any grid of (min_match, max_match, draft tokens), without an engine.

`python -m experiments.analysis.replay <run-id | records.jsonl> [min_match=1,2] [max_match=2,4] [k=1,2,4,8]`

The proposer is vLLM's `_find_longest_matched_ngram_and_propose_tokens` (v1/spec_decode/ngram_proposer.py):
over the context (prompt + output so far) take the longest suffix of length L <= max_match that occurs
earlier with at least one token after it; below min_match there is no draft. Among occurrences of that
suffix it copies the tokens after the *earliest* one, at most k and at most up to the end of the context.
A step verifies the draft against the recorded greedy continuation; it emits the accepted prefix plus one
token. The first output token comes from prefill, without a draft.

The algorithm (every position of a workload at once, numpy): experiments/analysis/ngram_replay.py.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

import numpy as np

from experiments.analysis.ngram_replay import (  # noqa: F401  (re-exported: the replay's public names live here too)
    DEFAULT_MAX_MODEL_LEN,
    NgramConfig,
    NgramIndex,
    ReplaySequence,
    ReplayStats,
    replay_config,
    total,
)
from experiments.analysis.runs import run_config
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.records import RecordsError, load_records, run_records

DEFAULT_GRID = {"min_match": [1, 2, 3], "max_match": [2, 3, 4, 5], "k": [1, 2, 4, 6, 8]}


class ReplayInputError(ValueError):
    """Input that cannot be replayed; nothing was written to the store."""


# ---------------------------------------------------------------- inputs

def sequences_from_records(records: list[dict], origin: str) -> list[ReplaySequence]:
    """Finished requests of a records file; refuses records that lack token ids or an empty workload."""
    if not records:
        raise ReplayInputError(f"{origin}: no request records (empty workload)")
    missing = [i for i, r in enumerate(records) if not isinstance(r.get("prompt_token_ids"), list)
               or not isinstance(r.get("output_token_ids"), list) or not r.get("prompt_token_ids")]
    if missing:
        raise ReplayInputError(f"{origin}: {len(missing)} of {len(records)} records carry no prompt/output token "
                               f"ids (first: line {missing[0] + 1}); replay needs prompt_token_ids and "
                               "output_token_ids as written by experiments/harness/client.py")
    ok = [r for r in records if not r.get("error") and r["output_token_ids"]]
    if not ok:
        raise ReplayInputError(f"{origin}: none of the {len(records)} requests finished with output tokens")
    return [ReplaySequence([int(t) for t in r["prompt_token_ids"]], [int(t) for t in r["output_token_ids"]],
                           str(r.get("prompt_id", i)), int(r.get("concurrency", 0)), int(r.get("repetition", 0)),
                           list(r.get("chunk_tokens") or []), list(r.get("chunk_times_s") or []))
            for i, r in enumerate(ok)]


@dataclass
class Source:
    sequences: list[ReplaySequence]
    label: str
    run: object | None = None        # mlflow Run when the records came from the store


def load_source(source: str, client) -> Source:
    """A records file (or folder of them) or an MLflow run id whose `records/` artifacts are replayed."""
    path = Path(source)
    try:
        if path.exists():
            return Source(sequences_from_records(load_records(path), str(path)), path.name)
        from mlflow.exceptions import MlflowException
        try:
            run = client.get_run(source)
        except MlflowException as exc:
            raise ReplayInputError(f"{source!r} is neither a records file nor a run in {client.tracking_uri}") from exc
        records = run_records(client, run.info.run_id)
    except RecordsError as exc:
        raise ReplayInputError(f"not JSON lines ({exc})") from exc
    if records is None:
        raise ReplayInputError(f"run {source} has no records/ artifact to replay")
    return Source(sequences_from_records(records, f"run {source}"), run.info.run_name or source, run)


def parse_grid(overrides: list[str]) -> list[NgramConfig]:
    grid = {k: list(v) for k, v in DEFAULT_GRID.items()}
    aliases = {"num_draft_tokens": "k", "min": "min_match", "max": "max_match"}
    for item in overrides:
        key, sep, values = item.partition("=")
        key = aliases.get(key, key)
        if not sep or key not in grid:
            raise ReplayInputError(f"grid override {item!r}: expected key=v1,v2 with key in {sorted(grid)}")
        try:
            grid[key] = [int(v) for v in values.split(",") if v]
        except ValueError as exc:
            raise ReplayInputError(f"grid override {item!r}: values must be integers") from exc
        if not grid[key] or min(grid[key]) < 1:
            raise ReplayInputError(f"grid override {item!r}: values must be integers >= 1")
    configs = [NgramConfig(a, b, k) for a, b, k in product(grid["min_match"], grid["max_match"], grid["k"]) if a <= b]
    if not configs:
        raise ReplayInputError("the grid has no configuration with min_match <= max_match")
    return configs


# ---------------------------------------------------------------- replay of a workload

def replay_workload(seqs: list[ReplaySequence], configs: list[NgramConfig],
                    max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> dict[NgramConfig, dict]:
    """Per configuration: workload totals, per concurrency level, per request."""
    index = NgramIndex(seqs, max(c.max_match for c in configs))
    out = {}
    for cfg in configs:
        per_request = replay_config(index, cfg, max_model_len)
        levels: dict[int, ReplayStats] = {}
        for seq, stats in zip(seqs, per_request, strict=True):
            levels.setdefault(seq.concurrency, ReplayStats()).add(stats)
        out[cfg] = {"total": total(per_request), "levels": levels,
                    "requests": [(s.prompt_id, s.concurrency, s.repetition, st)
                                 for s, st in zip(seqs, per_request, strict=True)]}
    return out


def engine_config(run) -> tuple[NgramConfig, int] | None:
    """The n-gram configuration a measured run served, where the replay reproduces its engine's drafter exactly
    (vLLM's prompt lookup); None for any other run."""
    config = run_config(run)
    try:
        window = config.ngram_window()
    except ValueError:   # a window setting left to the engine's default: not replayable
        return None
    if window is None or not window.exact:
        return None
    return NgramConfig(window.min_match, window.max_match, window.k), config.max_model_len or DEFAULT_MAX_MODEL_LEN


def approximation(run) -> NgramConfig | None:
    """The prompt-lookup chain that approximates a run's n-gram drafter where the engine's is not prompt lookup
    (SGLang's trie, experiments/engines/speculation.py): a lower bound; the gap to the engine is reported."""
    try:
        window = run_config(run).ngram_window()
    except ValueError:
        return None
    if window is None or window.exact:
        return None
    return NgramConfig(window.min_match, window.max_match, window.k)


def agreement(run, result: dict, seqs: list[ReplaySequence]) -> dict[str, float]:
    """Replay vs the engine's Prometheus counters (whole window) and, where the client saw one chunk per
    engine step, the per-step emitted tokens."""
    m = run.data.metrics
    rep = result["total"]
    acc = rep.acceptance()
    out = {"replay_drafts": rep.drafts, "replay_accepted": rep.accepted, "replay_accepted_upper": rep.accepted_upper,
           "replay_draft_tokens": rep.draft_tokens}
    if acc is not None:
        out |= {"replay_accept_length": acc.accept_length, "replay_acceptance_rate": acc.acceptance_rate}
        out |= {f"replay_accept_pos_{i}": p for i, p in enumerate(acc.per_position)}
    for key in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "accept_length", "acceptance_rate"):
        if key in m:
            out[f"engine_{key}"] = m[key]
    if "accept_length" in m and acc is not None:
        out["accept_length_abs_error"] = abs(acc.accept_length - m["accept_length"])
    if m.get("spec_drafts"):
        out["drafts_rel_error"] = abs(rep.drafts - m["spec_drafts"]) / m["spec_drafts"]
    for i in range(len(rep.per_pos)):
        if f"accept_pos_{i}" in m and acc is not None:
            out[f"accept_pos_{i}_abs_error"] = abs(acc.per_position[i] - m[f"accept_pos_{i}"])
    for c, stats in result["levels"].items():
        la = stats.acceptance()
        if la is not None and f"accept_length_c{c}" in m:
            out[f"accept_length_c{c}_abs_error"] = abs(la.accept_length - m[f"accept_length_c{c}"])
    # single stream: every streamed chunk is one engine step, so the step sequence itself can be compared
    index = NgramIndex(seqs, result["config"].max_match)
    per_request = replay_config(index, result["config"], result["max_model_len"], keep_emitted=True)
    singles = [(s, st) for s, st in zip(seqs, per_request, strict=True) if s.concurrency == 1 and s.chunk_tokens]
    if singles:
        same = sum(s.chunk_tokens == st.emitted for s, st in singles)
        out["c1_requests_step_sequence_exact"] = same / len(singles)
    return out


# ---------------------------------------------------------------- MLflow

def heatmap(results: dict[NgramConfig, dict]):
    """Accept length (per drafted step, vLLM's definition) and tokens per decode step over the grid:
    one panel column per min_match, rows max_match, columns draft tokens k."""
    from experiments.tracking.plots import plt
    mins = sorted({c.min_match for c in results})
    maxs = sorted({c.max_match for c in results})
    ks = sorted({c.k for c in results})
    fig, axes = plt.subplots(2, len(mins), figsize=(1.2 + 0.7 * len(ks) * len(mins) + 1.5 * len(mins), 7),
                             squeeze=False)
    for row, (key, title) in enumerate((("accept_length", "accept length (drafted steps)"),
                                        ("tokens_per_step", "tokens per decode step (all steps)"))):
        for col, mn in enumerate(mins):
            grid = np.full((len(maxs), len(ks)), np.nan)
            for c, r in results.items():
                if c.min_match == mn:
                    grid[maxs.index(c.max_match), ks.index(c.k)] = r["total"].metrics().get(key, np.nan)
            ax = axes[row][col]
            im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
            ax.set_xticks(range(len(ks)), [str(k) for k in ks])
            ax.set_yticks(range(len(maxs)), [str(m) for m in maxs])
            ax.set_xlabel("draft tokens k")
            ax.set_ylabel("max_match")
            ax.set_title(f"{title}\nmin_match={mn}", fontsize=9)
            fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    return fig


def to_json(results: dict[NgramConfig, dict]) -> dict:
    return {c.label: {"config": asdict(c), "total": r["total"].metrics(),
                      "levels": {str(lv): s.metrics() for lv, s in r["levels"].items()},
                      "requests": [{"prompt_id": p, "concurrency": lv, "repetition": rep,
                                    **{k: v for k, v in asdict(s).items() if k not in ("emitted", "verified")}}
                                   for p, lv, rep, s in r["requests"]]}
            for c, r in results.items()}


def log_replay(client, experiment_id: str, source: Source, source_ref: str, configs: list[NgramConfig],
               results: dict, engine_cmp: dict[str, float], max_model_len: int) -> str:
    """Created only now, with everything computed: a failure before this point leaves no run behind."""
    import mlflow
    tags = {"specws.mode": "replay", "specws.replay_of": source_ref}
    if source.run is not None:
        for key in ("specws.workload", "specws.model", "specws.site", "specws.option"):
            if key in source.run.data.tags:
                tags[key] = source.run.data.tags[key]
    grid = {key: sorted({getattr(c, key) for c in configs}) for key in ("min_match", "max_match", "k")}
    params = {f"grid.{k}": ",".join(map(str, v)) for k, v in grid.items()}
    params |= {"source": source_ref, "max_model_len": str(max_model_len), "requests": str(len(source.sequences))}
    metrics = dict(engine_cmp)
    for c, r in results.items():
        metrics |= {f"{c.label}/{k}": v for k, v in r["total"].metrics().items()
                    if k in ("accept_length", "acceptance_rate", "tokens_per_step", "steps_with_draft")}
    best = max(results, key=lambda c: results[c]["total"].metrics()["tokens_per_step"])
    params |= {"best_config": best.label}
    metrics["best_tokens_per_step"] = results[best]["total"].metrics()["tokens_per_step"]
    with tracked_run(client, experiment_id, f"replay-{source.label}"[:250], tags, params) as run:
        items = [mlflow.entities.Metric(k, float(v), 0, 0) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            client.log_batch(run.id, metrics=items[i: i + 500])
        client.log_dict(run.id, to_json(results), "replay.json")
        client.log_figure(run.id, heatmap(results), "plots/replay_heatmap.png")
    if source.run is not None:  # the link both ways: the measured run names its latest replay
        client.set_tag(source.run.info.run_id, "specws.last_replay_run_id", run.id)
    return run.id


def engine_comparison(source: Source, results: dict, served: NgramConfig | None, approx: NgramConfig | None,
                      max_model_len: int, console) -> dict[str, float]:
    """The replay against what the source run's engine counted: the served configuration's agreement, or the
    approximation's tokens per step against the engine's accept length."""
    engine_cmp: dict[str, float] = {}
    if served:
        res = results[served] | {"config": served, "max_model_len": max_model_len}
        engine_cmp = agreement(source.run, res, source.sequences)
        console.print(f"engine config {served.label}: " + ", ".join(f"{k}={v:.4g}" for k, v in engine_cmp.items()),
                      soft_wrap=True)
    if approx and "accept_length" in source.run.data.metrics:
        # SGLang's accept length counts every verify step: compare with tokens per decode step
        replayed = results[approx]["total"].metrics()["tokens_per_step"]
        measured = source.run.data.metrics["accept_length"]
        engine_cmp = {"sglang_approx_tokens_per_step": replayed, "engine_accept_length": measured,
                      "sglang_approx_rel_error": abs(replayed - measured) / measured}
        console.print(f"SGLang NGRAM approximated by {approx.label}: replay {replayed:.3f} tokens/step vs engine "
                      f"accept length {measured:.3f}")
    return engine_cmp


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from experiments.config.paths import ROOT
    parser = argparse.ArgumentParser(prog="python -m experiments.analysis.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="MLflow run id (its records/ artifacts) or a records .jsonl file / folder")
    parser.add_argument("grid", nargs="*", help=f"min_match=1,2 max_match=2,4 k=1,2,4,8 (defaults: {DEFAULT_GRID})")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    parser.add_argument("--experiment", default=None, help="default: the source run's experiment, else 'replay'")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-log", action="store_true", help="print only; write nothing to the store")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(args.tracking_uri)
    client = MlflowClient()
    try:
        configs = parse_grid(args.grid)
        source = load_source(args.source, client)
    except ReplayInputError as exc:
        console.print(f"[bold red]replay refused:[/] {exc}", soft_wrap=True)
        return 2
    served = engine_config(source.run) if source.run is not None else None
    max_model_len = args.max_model_len or (served[1] if served else DEFAULT_MAX_MODEL_LEN)
    if served and served[0] not in configs:
        configs.append(served[0])
    approx = approximation(source.run) if source.run is not None else None
    if approx and approx not in configs:
        configs.append(approx)
    results = replay_workload(source.sequences, configs, max_model_len)
    engine_cmp = engine_comparison(source, results, served[0] if served else None, approx, max_model_len, console)
    for c in sorted(results, key=lambda c: -results[c]["total"].metrics()["tokens_per_step"])[:10]:
        m = results[c]["total"].metrics()
        console.print(f"{c.label:>20}: accept_length={m.get('accept_length', float('nan')):.3f} "
                      f"tokens/step={m['tokens_per_step']:.3f} steps_with_draft={m['steps_with_draft']:.2f}",
                      soft_wrap=True)
    if args.no_log:
        return 0
    if args.experiment:
        exp = client.get_experiment_by_name(args.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(args.experiment)
    elif source.run is not None:
        exp_id = source.run.info.experiment_id
    else:
        exp = client.get_experiment_by_name("replay")
        exp_id = exp.experiment_id if exp else client.create_experiment("replay")
    ref = source.run.info.run_id if source.run is not None else str(Path(args.source).resolve())
    rid = log_replay(client, exp_id, source, ref, configs, results, engine_cmp, max_model_len)
    console.print(f"replay run {rid} ({len(configs)} configurations, {len(source.sequences)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
