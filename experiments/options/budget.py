"""Option E offline on a CPU site: `python -m experiments.options.budget [-m] [spec.moe_expert_budget=2,4,8,16,32]`.

The same Hydra config tree as `experiments.run` (`+option=E model=tiny_moe_dsv3` are added unless given);
SGLang cannot serve here, so the budget is applied in the HF forward of the small MoE: greedy speculative
decoding with n-gram (prompt-lookup) drafts of `spec.num_draft_tokens` tokens, every verification forward's
routing restricted by `sglang_patches.moe_budget.budget_topk` (the function the SGLang patch applies), decode
untouched. Per B one MLflow run (`E-offline`; a multirun adds the sweep parent with its plot): distinct
experts per MoE layer per verification step, accept length (tokens per verification step), agreement with
the unbudgeted speculative output and with plain greedy output, and tok/s of this CPU loop (eager HF on 1
thread: a relative number between budgets, not serving speed).
"""
from __future__ import annotations

import json
import os
import sys
import time

import hydra
import torch
from omegaconf import DictConfig

from experiments.config import paths  # noqa: F401  (registers the ws.* resolvers)
from experiments.config.views import views_of
from experiments.engines.config import engine_tags
from experiments.harness.measure import console
from experiments.harness.preflight import Refused, check_moe_model
from experiments.moe.routing import (
    AlongResult,
    SpecResult,
    agreement,
    greedy_continuations,
    mean,
    speculative_greedy,
    teacher_continuations,
    verify_along,
)
from experiments.tracking.runs import open_run

# Unbudgeted references are shared by the jobs of one multirun (same process).
_cache: dict[tuple, object] = {}


def _cached(key: tuple, make):
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]


def _summary(results: list[SpecResult]) -> dict[str, float]:
    steps = sum(r.verify_steps for r in results)
    tokens = sum(len(r.output) for r in results)
    distinct = [d for r in results for step in r.distinct for d in step]
    return {"distinct_experts_verify": mean(distinct), "distinct_experts_verify_max": float(max(distinct)),
            "accept_length": tokens / steps, "output_tokens": float(tokens), "verify_steps": float(steps),
            "tok_s": tokens / sum(r.seconds for r in results)}


def _along_summary(results: list[AlongResult]) -> dict[str, float]:
    steps = sum(r.verify_steps for r in results)
    distinct = [d for r in results for step in r.distinct for d in step]
    return {"distinct_experts_verify": mean(distinct), "distinct_experts_verify_max": float(max(distinct)),
            "accept_length": (sum(r.accepted_tokens for r in results) + steps) / steps,
            "verify_steps": float(steps), "verified_positions": float(sum(r.positions for r in results)),
            "tok_s": sum(r.accepted_tokens + r.verify_steps for r in results) / sum(r.seconds for r in results)}


def _along_teacher(model, ids: list[list[int]], max_new: int, k: int, budget: int) -> tuple[dict, list[dict]]:
    """Verification along SmolLM2's answers (real text; this small MoE's own greedy text is degenerate)."""
    texts = _cached(("teacher", json.dumps(ids), max_new), lambda: teacher_continuations(ids, max_new))
    free = _cached(("along", id(model), json.dumps(ids), max_new, k),
                   lambda: [verify_along(model, p, t, k, None) for p, t in zip(ids, texts, strict=True)])
    budgeted = [verify_along(model, p, t, k, budget) for p, t in zip(ids, texts, strict=True)]
    metrics = _along_summary(budgeted) | {f"unbudgeted/{key}": v for key, v in _along_summary(free).items()}
    metrics["agreement_vs_unbudgeted"] = sum(r.agreeing_positions for r in budgeted) / \
        sum(r.positions for r in budgeted)
    rows = [{"verify_steps": b.verify_steps, "accepted": b.accepted_tokens, "positions": b.positions,
             "agreeing": b.agreeing_positions, "distinct_per_step": b.distinct} for b in budgeted]
    return metrics, rows


def _free_running(model, ids, max_new, k, budget, eos, path, prompt_set) -> tuple[dict, list[dict]]:
    """Speculative decoding of the small MoE's own greedy output."""
    base = ("ref", path, prompt_set, max_new)
    greedy = _cached(base + ("greedy",), lambda: greedy_continuations(model, ids, max_new, eos))
    free = _cached(base + ("spec", k), lambda: [speculative_greedy(model, p, max_new, k, None, eos) for p in ids])
    budgeted = [speculative_greedy(model, p, max_new, k, budget, eos) for p in ids]
    metrics = _summary(budgeted) | {f"unbudgeted/{key}": v for key, v in _summary(free).items()}
    pairs = list(zip(budgeted, free, greedy, strict=True))
    metrics |= {"agreement_vs_unbudgeted": mean([agreement(b.output, f.output) for b, f, _ in pairs]),
                "identical_vs_unbudgeted": mean([float(b.output == f.output) for b, f, _ in pairs]),
                "agreement_vs_greedy": mean([agreement(b.output, g) for b, _, g in pairs]),
                "unbudgeted/agreement_vs_greedy": mean([agreement(f.output, g) for _, f, g in pairs])}
    rows = [{"tokens": len(b.output), "verify_steps": b.verify_steps, "agreement_vs_unbudgeted":
             agreement(b.output, f.output), "distinct_per_step": b.distinct} for b, f, _ in pairs]
    return metrics, rows


def run_offline(cfg: DictConfig) -> dict:
    from experiments.moe.model import load_model
    from experiments.moe.workload import token_prompts

    if cfg.option is None or "moe_budget" not in (cfg.option.get("patches") or []):
        raise Refused("experiments.options.budget runs an option with the MoE expert budget (+option=E)")
    view = views_of(cfg)
    check_moe_model(view)
    path = str(cfg.model.path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise Refused(f"model {cfg.model.name} not found at {path}: build it with python -m experiments.moe.build")
    budget, k = int(cfg.spec.moe_expert_budget), int(cfg.spec.num_draft_tokens)
    max_new = int(cfg.workload.max_tokens)
    torch.set_num_threads(1)
    model = _cached(("model", path), lambda: load_model(path))
    num_experts = model.config.n_routed_experts
    if budget < 1:
        raise Refused(f"spec.moe_expert_budget must be >= 1, got {budget}")
    w = cfg.workload
    prompts = token_prompts(str(w.prompt_set), path, w.get("num_prompts"), str(w.get("format", "auto")),
                            w.get("max_turns"))
    eos = model.config.eos_token_id
    ids = [p.token_ids for p in prompts]
    mode = str(cfg.spec.get("offline_mode") or "teacher_text")
    if mode == "teacher_text":
        metrics, per_prompt = _along_teacher(model, ids, max_new, k, budget)
    elif mode == "free":
        metrics, per_prompt = _free_running(model, ids, max_new, k, budget, eos, path, str(cfg.workload.prompt_set))
    else:
        raise Refused(f"spec.offline_mode must be teacher_text or free, got {mode!r}")
    metrics["budget_fraction"] = budget / num_experts
    tags = engine_tags(view, "hf-offline") | {"specws.spec_method": "ngram (offline, HF forward)"}
    with open_run(view, "measure", f"E-offline-B{budget}", tags) as run:
        client = run.client
        for key, value in metrics.items():
            client.log_metric(run.id, key, float(value))
        client.log_dict(run.id, {"mode": mode, "budget": budget, "k": k, "per_prompt": [
            {"id": p.id, **row} for p, row in zip(prompts, per_prompt, strict=True)]}, "option_e.json")
    run_id = run.id
    m = metrics
    console.print(f"E offline ({mode}) B={budget}/{num_experts} k={k}: distinct experts/layer/verify "
                  f"{m['distinct_experts_verify']:.2f} (unbudgeted {m['unbudgeted/distinct_experts_verify']:.2f}), "
                  f"accept length {m['accept_length']:.2f} ({m['unbudgeted/accept_length']:.2f}), agreement with "
                  f"unbudgeted greedy {m['agreement_vs_unbudgeted']:.3f}, {m['tok_s']:.1f} tok/s "
                  f"({m['unbudgeted/tok_s']:.1f}) — run {run_id}")
    return {"run_id": run_id, **metrics}


@hydra.main(config_path="../../conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    t0 = time.time()
    try:
        run_offline(cfg)
    except Refused as exc:
        console.print(f"[red]refused:[/] {exc}")
        sys.exit(2)
    console.print(f"done in {time.time() - t0:.0f}s")


def main() -> None:
    args = sys.argv[1:]
    if not any(a.startswith("+option=") for a in args):
        args.append("+option=E")
    if not any(a.startswith("model=") for a in args):
        args.append("model=tiny_moe_dsv3")
    sys.argv = [sys.argv[0], *args]
    _hydra_main()


if __name__ == "__main__":
    main()
