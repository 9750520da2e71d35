"""The speedup model's CLI.

`python -m experiments.analysis.speedup.cli table [--experiment E] [--log]`: predicted vs measured over every
measured run of a store (experiments/analysis/speedup/fit.py `error_table`); `--log` writes the predictions onto
runs measured before the model existed.
`python -m experiments.analysis.speedup.cli box [--expert-curve curve.json | --moe-kernel kimi_kernels.json]`: the
Blackwell box's speedup per option x drafter x k x concurrency as bands from ranged terms, the seed check and the
sensitivity table (experiments/analysis/speedup/box.py, box_terms.py, box_report.py); MoE distinct experts from
uniform routing (default) or a measured curve, or the H200's measured kernel times carried over as they are.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments.analysis.speedup.model import load_expert_curve
from experiments.config.kimi import KIMI


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
    b = sub.add_parser("box", help="speedup bands for Kimi-K2.5 on the Blackwell box, seed check, sensitivity")
    variant = b.add_mutually_exclusive_group()
    variant.add_argument("--expert-curve", type=Path, default=None,
                         help="distinct experts per MoE layer from a measured curve (JSON list or the telemetry file "
                              "experiments/moe writes, e.g. docs/journal/2026-12-02-h200/kimi_lease2/"
                              "served_expert_curve.json); default: uniform routing")
    variant.add_argument("--moe-kernel", type=Path, default=None,
                         help="MoE time vs tokens as the H200 kernel microbenchmark measured it "
                              "(experiments/box/kimi_kernels.py JSON), carried to the box as is (fixed share pinned)")
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
    from experiments.analysis.speedup import box as bx
    from experiments.analysis.speedup.box_report import render
    if args.expert_curve:
        curve = load_expert_curve(args.expert_curve, KIMI.routed_experts, KIMI.top_k)
        variant = bx.curve_variant(curve, args.expert_curve.name)
    elif args.moe_kernel:
        variant = bx.kernel_variant(args.moe_kernel)
    else:
        variant = bx.uniform_variant()
    print(render(variant, tuple(args.concurrency)))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.cmd == "table":
        table(args)
    else:
        box(args)


if __name__ == "__main__":
    main()
