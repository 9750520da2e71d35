"""The speedup model's CLI.

`python -m experiments.analysis.speedup.cli table [--experiment E] [--log]`: predicted vs measured over every
measured run of a store (experiments/analysis/speedup/fit.py `error_table`); `--log` writes the predictions onto
runs measured before the model existed.
`python -m experiments.analysis.speedup.cli box --tokens-per-step 2.4 --k 4 [--expert-curve curve.json]
[--moe-kernel kimi_kernels.json]`: the Blackwell box's speedup and break-even points
(experiments/analysis/speedup/model.py `BoxProfile`), the MoE term from distinct experts or a measured kernel curve.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments.analysis.speedup.model import (
    BoxProfile,
    break_even_concurrency,
    load_expert_curve,
    load_moe_time_curve,
    predict_level,
)


def parser() -> argparse.ArgumentParser:
    from experiments.config.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.speedup.cli")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="predicted vs measured tok/s over every measured run")
    t.add_argument("--experiment", default="smollm2_135m@local")
    t.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    t.add_argument("--no-replay", action="store_true", help="acceptance from engine counters only")
    t.add_argument("--no-probe", action="store_true", help="extra verified tokens cost as much as extra sequences")
    t.add_argument("--log", action="store_true", help="write predicted_* onto the runs (backfill)")
    b = sub.add_parser("box", help="predictions for Kimi-K2.5 on the Blackwell box")
    b.add_argument("--tokens-per-step", type=float, nargs="+", default=[1.5, 2.0, 2.5, 3.0, 3.5])
    b.add_argument("--k", type=int, default=4)
    b.add_argument("--draft-step-cost", type=float, default=0.0)
    b.add_argument("--expert-curve", type=Path, default=None,
                   help="JSON list (distinct experts at 1, 2, ... tokens) or experiments/moe/expert_growth.json")
    b.add_argument("--moe-kernel", type=Path, default=None,
                   help="MoE time vs tokens measured by experiments/moe/kimi_kernels.py (its JSON), at the TP-8 shard")
    b.add_argument("--moe-shard-n", type=int, default=256)
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    return ap


def table(args: argparse.Namespace) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    from experiments.analysis.speedup.fit import error_table
    mlflow.set_tracking_uri(args.tracking_uri)
    rows = error_table(MlflowClient(), args.experiment, not args.no_replay, not args.no_probe, args.log)
    print("| run | option | workload | k | c | acceptance | tokens/step | b_tok ms | spec overhead ms | "
          "baseline tok/s | measured tok/s | predicted tok/s | error | flag |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        print(f"| {r['run'][:8]} | {r['option']} {r['method']} | {r['workload']} | {r['k']} | {r['concurrency']} | "
              f"{r['acceptance_source']} | {r['tokens_per_step']:.2f} | "
              f"{'-' if r['b_tok_ms'] is None else format(r['b_tok_ms'], '.3f')} | "
              f"{r.get('spec_overhead_ms') or 0:.3f} | {r['baseline_tok_s']:.1f} | "
              f"{r['measured_tok_s']:.1f} | {r['predicted_tok_s']:.1f} | {100 * r['rel_error']:.1f} % | "
              f"{r.get('flag') or ''} |")
    for label, sel in (("all", ok), ("unflagged", [r for r in ok if not r.get("flag")])):
        errs = np.array([r["rel_error"] for r in sel])
        if len(errs):
            print(f"\n{label}: {len(errs)} configurations: mean error {100 * errs.mean():.1f} %, median "
                  f"{100 * np.median(errs):.1f} %, max {100 * errs.max():.1f} %, within 15 %: "
                  f"{int((errs <= 0.15).sum())}/{len(errs)}")
    for note in dict.fromkeys(f"{r['run'][:8]}: {r['note']}" for r in ok if r.get("note")):
        print(f"inputs {note}")
    for r in rows:
        if "error" in r:
            print(f"not predicted: {r['run'][:8]}: {r['error']}")


def box(args: argparse.Namespace) -> None:
    curve = load_expert_curve(args.expert_curve, BoxProfile.experts, BoxProfile.top_k) if args.expert_curve else None
    moe = load_moe_time_curve(args.moe_kernel, args.moe_shard_n) if args.moe_kernel else None
    profile = BoxProfile(expert_curve=curve, moe_time_curve=moe)
    base128 = profile.step_ms(profile.plateau_concurrency, 1.0)
    print(f"box profile: single stream {profile.t1_ms:.2f} ms/step; at c={profile.plateau_concurrency} the components "
          f"give {base128:.1f} ms/step = {profile.plateau_concurrency * 1000 / base128:.0f} tok/s (measured plateau "
          f"{profile.plateau_tok_s:.0f}); attention growth {profile.attention_growth:.4f}/seq; AllReduce "
          f"{profile.allreduce_ms_per_token():.4f} ms and GEMM FLOPs {profile.gemm_compute_ms_per_token():.4f} ms "
          "per token")
    print("| tokens/step | " + " | ".join(f"c={c}" for c in args.concurrency) + " | break-even c |")
    print("|---" * (len(args.concurrency) + 2) + "|")
    for tau in args.tokens_per_step:
        cells = [predict_level(profile, c, tau, args.k, 1.0, args.draft_step_cost).speedup for c in args.concurrency]
        be = break_even_concurrency(profile, tau, args.k, 1.0, args.draft_step_cost)
        print(f"| {tau:.2f} | " + " | ".join(f"{x:.2f}x" for x in cells) + f" | {be:.0f} |")
    print(f"break-even tokens per step (all steps drafted, k={args.k}): " + ", ".join(
        f"c={c}: {predict_level(profile, c, 1.0, args.k, 1.0, args.draft_step_cost).break_even_accept_length:.2f}"
        for c in args.concurrency))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.cmd == "table":
        table(args)
    else:
        box(args)


if __name__ == "__main__":
    main()
