"""Baseline pairing: find (or be told to measure) the baseline an option is judged against, and check
that greedy outputs are the baseline's, telling numerical near-ties from real divergence."""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from experiments.prompts import prompt_set_path

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

TopK = Callable[[list[int]], list[tuple[int, float]]]


def pair_key(cfg: DictConfig, engine_version: str) -> str:
    """What must match for two runs to be compared: site, model, engine + version, server flags other
    than speculation, and the whole workload including the prompt set's content."""
    ident = {"site": cfg.site.name, "model": cfg.model.name, "model_path": str(cfg.model.path),
             "engine": cfg.engine.name, "engine_version": engine_version,
             "site_args": OmegaConf.to_container(cfg.site.engine_args.get(cfg.engine.name) or []),
             "extra_args": OmegaConf.to_container(cfg.engine.extra_args),
             "workload": OmegaConf.to_container(cfg.workload, resolve=True),
             "prompts_sha": hashlib.sha256(prompt_set_path(cfg.workload.prompt_set).read_bytes()).hexdigest()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def find_baseline(client: MlflowClient, experiment_id: str, key: str) -> Run | None:
    runs = client.search_runs(
        [experiment_id],
        filter_string=(f"tags.`specws.option` = 'baseline' AND tags.`specws.pair_key` = '{key}' "
                       "AND tags.`specws.mode` = 'measure' AND attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def speedups(option_metrics: dict[str, float], baseline_metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for name, value in option_metrics.items():
        if name.startswith("output_tok_s_c") and baseline_metrics.get(name):
            out["speedup_vs_baseline_c" + name.removeprefix("output_tok_s_c")] = value / baseline_metrics[name]
    if baseline_metrics.get("output_tok_s"):
        out["speedup_vs_baseline"] = option_metrics["output_tok_s"] / baseline_metrics["output_tok_s"]
    return out


def _reference(records: list[dict]) -> dict[str, dict]:
    """One baseline output per prompt: the lowest concurrency, first repetition."""
    ref: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: (r["concurrency"], r["repetition"])):
        if r.get("error") is None:
            ref.setdefault(r["prompt_id"], r)
    return ref


def compare_greedy(option_records: list[dict], baseline_records: list[dict], topk: TopK | None,
                   margin: float) -> tuple[dict[str, float], list[dict]]:
    """Token agreement of every option output with the baseline output of the same prompt. At the
    first divergence the target's top-k log-probabilities decide: when both chosen tokens are within
    `margin` of the most likely one it is a numerical near-tie (batching/precision; bf16 often ties
    three ways), otherwise a real divergence (a lossy speculation bug)."""
    ref = _reference(baseline_records)
    rows, cache = [], {}
    for rec in option_records:
        base = ref.get(rec["prompt_id"])
        if rec.get("error") is not None or base is None:
            continue
        a, b = rec["output_token_ids"], base["output_token_ids"]
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        row = {"prompt_id": rec["prompt_id"], "concurrency": rec["concurrency"],
               "repetition": rec["repetition"], "tokens": len(a), "baseline_tokens": len(b),
               "agreeing_prefix": n, "first_divergence": None, "kind": "identical", "tie_gap": None}
        if a != b:
            row["first_divergence"] = n
            row["kind"] = "length"  # one stopped earlier without a differing token
            if n < min(len(a), len(b)) and topk is not None:
                ctx = tuple(rec["prompt_token_ids"] + b[:n])
                if ctx not in cache:
                    cache[ctx] = dict(topk(list(ctx)))
                logprobs = cache[ctx]
                best = max(logprobs.values())
                # a chosen token missing from the top-k is infinitely far from a tie
                gap = max(best - logprobs.get(a[n], -math.inf), best - logprobs.get(b[n], -math.inf))
                row["tie_gap"] = gap
                row["kind"] = "near_tie" if gap <= margin else "divergence"
            elif n < min(len(a), len(b)):
                row["kind"] = "divergence"
        rows.append(row)
    if not rows:
        return {}, rows
    metrics = {
        "greedy_compared": float(len(rows)),
        "greedy_exact_match": sum(r["kind"] == "identical" for r in rows) / len(rows),
        "greedy_token_agreement": sum(r["agreeing_prefix"] / max(1, r["baseline_tokens"]) for r in rows) / len(rows),
        "greedy_near_ties": float(sum(r["kind"] == "near_tie" for r in rows)),
        "greedy_real_divergences": float(sum(r["kind"] == "divergence" for r in rows)),
    }
    firsts = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    if firsts:
        metrics["greedy_first_divergence_min"] = float(min(firsts))
    return metrics, rows
