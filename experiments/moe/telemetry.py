"""`python -m experiments.moe.telemetry`: offline expert-activation telemetry of the small MoE, to MLflow.

On the prompts of experiments/moe/prompts.json (chat, grounded, reasoning): the model's greedy continuations,
every token's routing (HF forward with router hooks), then the distinct experts per MoE layer per forward step
for decode (1 token per sequence) and verification with k draft tokens (k+1 per sequence), at several
concurrencies. Logged as one MLflow run (`E-telemetry`, experiment <model>@<site>): metrics per (k, c),
plots, and `expert_growth.json` — distinct experts vs tokens per step, the curve the speedup model reads
(also written to experiments/moe/expert_growth.json).

`--served DIR` adds the H200 results (h200_serve.py's decode.json / ngram.json): served distinct experts per
(mode, tokens, batch) next to the offline curve at the same tokens per step, and the served greedy outputs'
agreement with the offline ones.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments.moe.model import load_model, model_dir
from experiments.moe.routing import (
    greedy_continuations,
    independent_expectation,
    mean,
    step_distinct,
    teacher_continuations,
    token_routing,
)
from experiments.moe.served_curve import DECODE, VERIFY, load_phase, telemetry_keys
from experiments.moe.workload import load as load_prompts

GROWTH_FILE = Path(__file__).with_name("expert_growth.json")
KS = (0, 1, 2, 4, 8)            # 0 = decode
CONCURRENCY = (1, 2, 4, 8)


def measure(model, prompts: list[dict], max_new_tokens: int, ks=KS, concurrency=CONCURRENCY,
            source: str = "teacher") -> dict:
    """source "teacher": SmolLM2's greedy answers (real text; the MoE was distilled from them); "self": the
    MoE's own greedy continuations (what the served model generates; degenerate for this weak model)."""
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
    t0 = time.time()
    ids = [p["token_ids"] for p in prompts]
    conts = teacher_continuations(ids, max_new_tokens) if source == "teacher" else \
        greedy_continuations(model, ids, max_new_tokens, eos)
    routing = [token_routing(model, p["token_ids"] + c) for p, c in zip(prompts, conts, strict=True)]
    starts = [len(p["token_ids"]) for p in prompts]
    lengths = [len(c) for c in conts]
    points = []
    for k in ks:
        for c in concurrency:
            steps = step_distinct(routing, starts, lengths, k, c)
            if not steps:
                continue
            per_layer = [mean([s[layer] for s in steps]) for layer in range(len(steps[0]))]
            tokens = c * (k + 1)
            points.append({"k": k, "concurrency": c, "tokens_per_step": tokens, "steps": len(steps),
                           "mean_distinct": mean(per_layer), "per_layer": per_layer,
                           "independent_expectation": independent_expectation(
                               cfg.n_routed_experts, cfg.num_experts_per_tok, tokens)})
    return {"model": str(getattr(cfg, "_name_or_path", "")), "source": source, "num_experts": cfg.n_routed_experts,
            "top_k": cfg.num_experts_per_tok, "moe_layers": len(routing[0]), "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "continuation_tokens": sum(lengths), "points": points,
            "growth": growth_curve(points), "seconds": round(time.time() - t0, 1),
            "continuations": {p["id"]: c for p, c in zip(prompts, conts, strict=True)}}


def growth_curve(points: list[dict]) -> list[dict]:
    """Distinct experts (fraction of all) vs tokens per step, averaged over the (k, c) that give the same
    token count — what a speedup model needs: verification cost grows with the experts it touches."""
    by_tokens: dict[int, list[float]] = {}
    for p in points:
        by_tokens.setdefault(p["tokens_per_step"], []).append(p["mean_distinct"])
    return [{"tokens_per_step": t, "mean_distinct": mean(v)} for t, v in sorted(by_tokens.items())]


def served_passes(decode: dict, ngram: dict) -> list[dict]:
    """Every pass of the served decode and NGRAM phases, each NGRAM pass tagged with its config's k."""
    return decode.get("passes", []) + [p | {"k": c["k"]} for c in ngram.get("configs", []) for p in c["passes"]]


def served_comparison(result: dict, served_dir: Path, model=None) -> dict:
    """Served (H200) distinct experts next to the offline curve at the same tokens per step and batch."""
    offline = {(p["tokens_per_step"], p["concurrency"]): p["mean_distinct"] for p in result["points"]}
    decode, ngram = (load_phase(served_dir, phase) or {} for phase in ("decode", "ngram"))
    rows = [{"mode": mode, "tokens": tokens, "bs": bs, "served": s["mean_distinct"], "forwards": s["forwards"],
             "offline": offline.get((tokens, bs))}
            for p, mode, tokens, bs, s in telemetry_keys(served_passes(decode, ngram))
            if mode in (DECODE, VERIFY) and p.get("budget") in (None, result["num_experts"])]
    extend = []
    if model is not None and decode.get("extend"):
        texts = {p["id"]: p["token_ids"] + p.get("teacher_ids", []) for p in load_prompts()}
        for row in decode["extend"]:
            routing = token_routing(model, texts[row["id"]])
            offline_distinct = [int(torch.unique(layer[-row["tokens"]:]).numel()) for layer in routing]
            extend.append({"id": row["id"], "tokens": row["tokens"], "served": row["distinct"],
                           "offline": offline_distinct})
    agree = []
    for p in decode.get("passes", []):
        for r in p["requests"]:
            ref = result["continuations"].get(r["id"])
            if ref is not None and r.get("output_ids"):
                n = min(len(ref), len(r["output_ids"]))
                agree.append(ref[:n] == r["output_ids"][:n])
    return {"rows": rows, "greedy_outputs_identical": (sum(agree), len(agree)), "extend": extend,
            "budget_grid": budget_grid(ngram)}


def budget_grid(ngram: dict) -> list[dict]:
    """Per (k, B, concurrency) of the served NGRAM runs (`ngram.json`): verify-step distinct experts, accept length,
    tok/s, and the share of requests whose output equals the same server's B = all-experts output."""
    out = []
    for cfg in ngram.get("configs", []):
        ref = {p["concurrency"]: {r["id"]: r.get("output_ids") for r in p["requests"]}
               for p in cfg["passes"] if p.get("budget") == cfg["passes"][0].get("budget")}
        for p in cfg["passes"]:
            same = [r.get("output_ids") == ref.get(p["concurrency"], {}).get(r["id"]) for r in p["requests"]]
            verify = (p.get("telemetry") or {}).get(VERIFY, {})
            out.append({"k": cfg["k"], "budget": p.get("budget"), "concurrency": p["concurrency"],
                        "distinct_verify": verify.get("mean_distinct"), "tok_s": p["tok_s"],
                        "accept_length": p.get("accept_length_tokens_per_verify"),
                        "identical_to_unbudgeted": sum(same) / max(len(same), 1)})
    return out


def figures(result: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for k in sorted({p["k"] for p in result["points"]}):
        pts = sorted((p for p in result["points"] if p["k"] == k), key=lambda p: p["concurrency"])
        ax[0].plot([p["concurrency"] for p in pts], [p["mean_distinct"] for p in pts], marker="o",
                   label="decode" if k == 0 else f"verify k={k}")
    ax[0].set(xlabel="concurrency (sequences per step)", ylabel="distinct experts per MoE layer per step",
              title=f"{result['num_experts']} experts, top-{result['top_k']}, {result['source']} text")
    ax[0].axhline(result["num_experts"], color="grey", lw=0.5)
    ax[0].legend()
    g = result["growth"]
    t = [p["tokens_per_step"] for p in g]
    ax[1].plot(t, [p["mean_distinct"] for p in g], marker="o", label="measured (learned routing)")
    ax[1].plot(t, [independent_expectation(result["num_experts"], result["top_k"], x) for x in t], ls="--",
               label="independent uniform picks")
    ax[1].set(xscale="log", xlabel="tokens per forward step", ylabel="distinct experts", title="expert growth")
    ax[1].legend()
    fig.tight_layout()
    return fig


def log_run(result: dict, own: dict, served: dict | None, overrides: list[str]) -> str:
    from hydra import compose, initialize_config_dir

    from experiments.config.paths import ROOT
    from experiments.config.views import views_of
    from experiments.engines.config import engine_tags
    from experiments.tracking.runs import open_run
    from experiments.tracking.store import flatten

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=tiny_moe_dsv3", "+option=E", *overrides])
    params = {k: v for k, v in flatten(cfg).items() if k.startswith(("model.", "site.name"))}
    params |= {"telemetry.max_new_tokens": str(result["max_new_tokens"]), "telemetry.prompts": str(result["prompts"])}
    view = views_of(cfg)
    with open_run(view, "telemetry", "E-telemetry", engine_tags(view, "hf-offline"), params) as run:
        _log_growth(run.client, run.id, result, own, served)
    return run.id


def _log_growth(client, run_id: str, result: dict, own: dict, served: dict | None) -> None:
    for res, prefix in ((result, ""), (own, "self/")):
        for p in res["points"]:
            tag = "decode" if p["k"] == 0 else f"verify_k{p['k']}"
            client.log_metric(run_id, f"{prefix}distinct_experts/{tag}", p["mean_distinct"], step=p["concurrency"])
        for p in res["growth"]:
            client.log_metric(run_id, f"{prefix}expert_growth/mean_distinct", p["mean_distinct"],
                              step=p["tokens_per_step"])
    client.log_figure(run_id, figures(result), "plots/expert_growth.png")
    client.log_figure(run_id, figures(own), "plots/expert_growth_self.png")
    client.log_dict(run_id, {k: v for k, v in result.items() if k != "continuations"}, "expert_growth.json")
    client.log_dict(run_id, {k: v for k, v in own.items() if k != "continuations"}, "expert_growth_self.json")
    if served:
        client.log_dict(run_id, served, "served_comparison.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=0, help="first N prompts only")
    p.add_argument("--served", type=Path, default=None, help="h200_serve.py output folder to compare with")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the tracking config (e.g. site=h200)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(a.model or model_dir())
    prompts = load_prompts()
    prompts = prompts[:a.limit] if a.limit else prompts
    result = measure(model, prompts, a.max_new_tokens, source="teacher")
    own = measure(model, prompts, a.max_new_tokens, source="self")
    served = served_comparison(own, a.served, model) if a.served else None
    GROWTH_FILE.write_text(json.dumps({k: v for k, v in result.items() if k != "continuations"}, indent=1) + "\n")
    for res in (result, own):
        for pt in res["points"]:
            print(f"[{res['source']}] k={pt['k']} c={pt['concurrency']} tokens/step={pt['tokens_per_step']}: "
                  f"{pt['mean_distinct']:.2f} distinct experts/layer (independent picks: "
                  f"{pt['independent_expectation']:.2f})")
    if served:
        print(json.dumps(served, indent=1))
    if not a.no_mlflow:
        print(f"MLflow run {log_run(result, own, served, a.overrides)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
