"""Step-cost profiles from measured runs.

    bin/probe [overrides]                                       # the probe runs (baseline, n-gram k = 2/4/8, EAGLE-3
                                                                #   1/3 steps, workload=probe) on this site
    python -m experiments.analysis.speedup.probe fit --experiment <model>@<site> [--tracking-uri URI | offline://DIR]
    python -m experiments.analysis.speedup.probe show [FILE]

`fit` reads every finished measured run of the experiment (records: one streamed chunk per engine step), fits the
step costs per CUDA-graph regime (experiments/analysis/speedup/stepcost.py) for each engine / release / model / site
found, writes `experiments/analysis/speedup/profiles/<engine>-<version>-<model>-<site>.json` and logs a run
(tag `specws.mode=step_cost`) with the profile as its artifact `step_cost_profile.json`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.analysis.runs import run_config
from experiments.analysis.speedup.stepcost import (
    PROFILES,
    StepCostProfile,
    fit_profile,
    key_of,
    level_steps,
    save_profile,
)
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.offline_store import client_for

MEASURED = "tags.`specws.mode` = 'measure' and attributes.status = 'FINISHED'"


def fit_experiment(client, experiment: str, lease: str = "") -> list[StepCostProfile]:
    """One profile per engine / release / model / site among the experiment's measured runs."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in the store")
    runs = client.search_runs([exp.experiment_id], MEASURED, max_results=5000)
    groups: dict = {}
    for run in runs:
        groups.setdefault(key_of(run).stem, []).append(run)
    profiles = []
    for stem, members in sorted(groups.items()):
        steps = level_steps(client, members, lease)
        if not any(s.method != "none" and s.excess_ms is not None for s in steps):
            print(f"{stem}: no speculative run paired with a baseline; nothing to fit", file=sys.stderr)
            continue
        regimes = sorted({s.regime for s in steps})
        cap = next((run_config(r).graph_batch_limit for r in members if run_config(r).graph_batch_limit), None)
        profile = fit_profile(key_of(members[0]), steps, cap,
                              note=f"fitted on {len(members)} runs of {experiment}; regimes {regimes}")
        profiles.append(profile)
    return profiles


def log_profile(client, experiment_id: str, profile: StepCostProfile) -> str:
    tags = {"specws.mode": "step_cost", "specws.engine": profile.key.engine,
            "specws.engine_version": profile.key.version, "specws.model": profile.key.model,
            "specws.site": profile.key.site, "specws.engine_flags": profile.key.flags}
    with tracked_run(client, experiment_id, f"step-cost-{profile.key.stem}", tags) as run:
        client.log_dict(run.id, profile.to_json(), "step_cost_profile.json")
    return run.id


def show(profile: StepCostProfile) -> list[str]:
    lines = [f"{profile.key.stem} (flags {profile.key.flags}, CUDA-graph cap {profile.graph_cap}), "
             f"{len(profile.runs)} runs"]
    for name, r in profile.regimes.items():
        lines.append(f"  {name}: decode {r.decode_a_ms} + {r.decode_b_seq_ms} c ms; n-gram verify excess "
                     f"{r.over_ms} + {r.over_seq_ms} c + {r.b_tok_ms} c (q - 1) ms; EAGLE-3 {r.eagle_over_ms} + "
                     f"{r.eagle_over_seq_ms} c ms + {r.draft_ms} ms per draft step; residual "
                     f"{100 * r.residual_rel:.0f} % over {len(r.points)} points")
    return lines


def main(argv: list[str] | None = None) -> int:
    from experiments.config.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.speedup.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit step-cost profiles from an experiment's measured runs")
    f.add_argument("--experiment", required=True)
    f.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    f.add_argument("--lease", default="", help="a name for the measurements' session (kept in the profile)")
    f.add_argument("--out", type=Path, default=PROFILES)
    f.add_argument("--no-log", action="store_true", help="write the JSON only")
    s = sub.add_parser("show", help="print stored profiles")
    s.add_argument("files", nargs="*", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "show":
        for path in a.files or sorted(PROFILES.glob("*.json")):
            print("\n".join(show(StepCostProfile.from_json(json.loads(path.read_text())))))
        return 0
    client = client_for(a.tracking_uri)
    profiles = fit_experiment(client, a.experiment, a.lease)
    if not profiles:
        print("nothing fitted", file=sys.stderr)
        return 2
    for profile in profiles:
        path = save_profile(profile, a.out)
        print("\n".join(show(profile)) + f"\n  -> {path}")
        if not a.no_log:
            exp = client.get_experiment_by_name(a.experiment)
            print(f"  logged as run {log_profile(client, exp.experiment_id, profile)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
