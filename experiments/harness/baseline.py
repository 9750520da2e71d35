"""Baseline pairing: find (or be told to measure) the baseline an option is judged against, and check
that greedy outputs are the baseline's, telling numerical near-ties from real divergence."""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from scipy import stats

from experiments.config.views import RunView, WorkloadView
from experiments.engines.config import server_env, site_args
from experiments.engines.served import Served, behaviour_settings
from experiments.tracking.redact import redact_env

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

TopK = Callable[[list[int]], list[tuple[int, float]]]


HOST_LOADED_TAG = "specws.host_loaded"   # "true": other processes kept the host busy while it was measured


class PairingRefused(RuntimeError):
    """An option and a baseline that must not be compared (different engine limits)."""


def pair_key(run: RunView, engine_version: str, prompts_digest: str) -> str:
    """What must match for two runs to be compared: site, model, the engine (module, interpreter, version), every
    server flag other than speculation, the engine's environment (engine.env and site.env; a secret-named value
    counts by name only), the pinned engine limits, and the whole workload including the loaded prompts'
    content."""
    engine = run.engine_start
    ident = {"site": run.site.name, "model": run.model.name, "model_path": str(run.model.path),
             "engine": run.engine, "engine_version": engine_version, "engine_module": engine.module,
             "engine_python": engine.python, "engine_env": redact_env(server_env(run)),
             "site_args": site_args(run), "extra_args": list(engine.extra_args), "limits": asdict(run.limits),
             **_workload_ident(run.workload, prompts_digest)}
    return _digest(ident)


def served_pair_key(run: RunView, served: Served, prompts_digest: str) -> str:
    """The pairing key of a running server (`server.url`, `baseline.url`): its settings as read back from it, the
    speculative and per-launch ones left out (experiments/engines/served.py), stand in for the command line."""
    ident = {"site": run.site.name, "model": run.model.name, "engine": served.engine,
             "engine_version": served.version, "served": behaviour_settings(served.settings),
             **_workload_ident(run.workload, prompts_digest)}
    return _digest(ident)


# how long the client waits: not what is measured, so a baseline stays reusable when they change
# how a run is judged, not what it measures: the latency targets are applied to both runs' records afterwards
NOT_MEASURED = ("request_timeout_s", "stall_timeout_s", "level_timeout_s", "floor_tok_s", "max_error_share", "slo")
ARRIVAL_KEYS = ("arrival", "rate", "burstiness", "arrival_seed")


def _workload_ident(workload: WorkloadView, prompts_digest: str) -> dict:
    measured = {k: v for k, v in asdict(workload).items() if k not in NOT_MEASURED + ARRIVAL_KEYS}
    return {"workload": measured, "arrivals": arrival_ident(workload), "prompts_sha": prompts_digest}


def arrival_ident(workload: WorkloadView) -> dict:
    """The load as the client sends it: closed loop, or the arrival process an open-loop run draws its schedule
    from (poisson is gamma of shape 1; a null arrival_seed is the workload's seed), so that an open-loop run pairs
    only with a baseline released on the same schedules."""
    if not workload.open_loop:
        return {"kind": "closed"}
    return {"kind": "gamma", "rate": float(workload.rate), "shape": float(workload.burstiness),
            "seed": int(workload.arrival_seed_used)}


def _digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_baseline(client: MlflowClient, experiment_id: str, key: str, host: str,
                  max_age_h: float, allow_loaded_host: bool = False) -> Run | None:
    """The newest finished baseline with this pairing key that can stand in for a fresh one: no failed request,
    measured on this host (same `specws.host` tag: machine, accelerator, engine environment), at most
    `max_age_h` hours ago -- the drift check -- and, unless `allow_loaded_host`, not on a host that other
    processes kept busy (`specws.host_loaded`). Engine limits are compared once the option's server is up."""
    since = int((time.time() - max_age_h * 3600) * 1000)
    runs = client.search_runs(
        [experiment_id],
        filter_string=(f"tags.`specws.option` = 'baseline' AND tags.`specws.pair_key` = '{key}' "
                       "AND tags.`specws.mode` = 'measure' AND attributes.status = 'FINISHED' "
                       f"AND attributes.start_time >= {since}"),
        order_by=["attributes.start_time DESC"], max_results=20)
    for run in runs:
        loaded = run.data.tags.get(HOST_LOADED_TAG) == "true"
        if run.data.metrics.get("errors", 1.0) == 0.0 and run.data.tags.get("specws.host") == host and \
                (allow_loaded_host or not loaded):
            return run
    return None


RATIOS = {"output_tok_s_c": "speedup_vs_baseline_c", "goodput_req_s_c": "goodput_vs_baseline_c"}


def speedups(option_metrics: dict[str, float], baseline_metrics: dict[str, float]) -> dict[str, float]:
    """Per level, the option's output tok/s over the baseline's (`speedup_vs_baseline_c<c>`) and, where targets
    were set, its goodput over the baseline's (`goodput_vs_baseline_c<c>`); the lowest level's tok/s ratio as the
    run's `speedup_vs_baseline`."""
    out = {}
    for name, value in option_metrics.items():
        for measured, ratio in RATIOS.items():
            if name.startswith(measured) and baseline_metrics.get(name):
                out[ratio + name.removeprefix(measured)] = value / baseline_metrics[name]
    if baseline_metrics.get("output_tok_s"):
        out["speedup_vs_baseline"] = option_metrics["output_tok_s"] / baseline_metrics["output_tok_s"]
    return out


def slo_breaks(option_metrics: dict[str, float], baseline_metrics: dict[str, float]) -> dict[str, float]:
    """`slo_breaks_c<c>`: how many latency targets the option's level misses (its p99 above the target) that the
    baseline's same level meets; such a level does not pay, whatever its throughput. Only where targets were set
    (the summary's `slo_<name>_met_c<c>`); option and baseline share them (the workload is in the pairing key)."""
    out: dict[str, float] = {}
    for name, met in option_metrics.items():
        if not (name.startswith("slo_") and "_met_c" in name) or name.startswith("slo_met_c"):
            continue
        level = name.rsplit("_c", 1)[1]
        broken = met == 0.0 and baseline_metrics.get(name) == 1.0
        out[f"slo_breaks_c{level}"] = out.get(f"slo_breaks_c{level}", 0.0) + float(broken)
    return out


def _reference(records: list[dict]) -> dict[tuple[str, int], dict]:
    """One baseline output per prompt and turn: the lowest concurrency, first repetition."""
    ref: dict[tuple[str, int], dict] = {}
    for r in sorted(records, key=lambda r: (r["concurrency"], r["repetition"])):
        if r.get("error") is None:
            ref.setdefault((r["prompt_id"], r.get("turn", 0)), r)
    return ref


def compare_sampled(option_records: list[dict], baseline_records: list[dict]) -> tuple[dict[str, float], dict]:
    """At temperature > 0 outputs are draws, so token agreement says nothing: a lossless speculation draws from
    the target's distribution, so its outputs' lengths and token frequencies must look like the baseline's.
    Two-sample Kolmogorov-Smirnov test of output lengths, and the total-variation distance between the two runs'
    output-token frequencies (against the same distance between the baseline's two halves: sampling noise)."""
    opt = [r for r in option_records if r.get("error") is None]
    base = [r for r in baseline_records if r.get("error") is None]
    if len(opt) < 2 or len(base) < 4:
        return {}, {"note": "too few requests for a distribution check"}
    ks = stats.ks_2samp([len(r["output_token_ids"]) for r in opt], [len(r["output_token_ids"]) for r in base])
    tv = _token_tv(opt, base)
    noise = _token_tv(base[0::2], base[1::2])
    metrics = {"sampled_length_ks_p": float(ks.pvalue), "sampled_token_tv": tv, "sampled_token_tv_noise": noise}
    return metrics, {**metrics, "option_requests": len(opt), "baseline_requests": len(base)}


def _token_tv(a: list[dict], b: list[dict]) -> float:
    ca = Counter(t for r in a for t in r["output_token_ids"])
    cb = Counter(t for r in b for t in r["output_token_ids"])
    na, nb = sum(ca.values()) or 1, sum(cb.values()) or 1
    return 0.5 * sum(abs(ca[t] / na - cb[t] / nb) for t in ca.keys() | cb.keys())


def compare_greedy(option_records: list[dict], baseline_records: list[dict], topk: TopK | None,
                   margin: float) -> tuple[dict[str, float], list[dict]]:
    """Token agreement of every option output with the baseline output of the same prompt. At the
    first divergence the target's top-k log-probabilities decide: when both chosen tokens are within
    `margin` of the most likely one it is a numerical near-tie (batching/precision; bf16 often ties
    three ways), otherwise a real divergence (a lossy speculation bug)."""
    ref = _reference(baseline_records)
    rows, cache = [], {}
    for rec in option_records:
        base = ref.get((rec["prompt_id"], rec.get("turn", 0)))
        if rec.get("error") is not None or base is None:
            continue
        if rec["prompt_token_ids"] != base["prompt_token_ids"]:   # a later turn after answers that differed
            continue
        a, b = rec["output_token_ids"], base["output_token_ids"]
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        row = {"prompt_id": rec["prompt_id"], "turn": rec.get("turn", 0), "concurrency": rec["concurrency"],
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
                # logits are bf16 on the engines: a gap of exactly the margin arrives as 0.25000006 after the
                # float32 log-softmax, so the comparison allows float32 rounding
                row["kind"] = "near_tie" if gap <= margin + 1e-6 else "divergence"
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
