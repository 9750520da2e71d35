"""Replay vs engine on every finished vLLM n-gram run of an experiment: a markdown table.

`python -m experiments.bench.replay_agreement [--experiment smollm2_135m@local] [--tracking-uri ...]`
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import mlflow  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from experiments.analysis.replay import agreement, engine_config, load_source, replay_workload  # noqa: E402
from experiments.config.paths import ROOT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", default="smollm2_135m@local")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    args = ap.parse_args()
    mlflow.set_tracking_uri(args.tracking_uri)
    client = MlflowClient()
    exp = client.get_experiment_by_name(args.experiment)
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED' and params.`spec.method` = 'ngram'"
                              " and tags.`specws.mode` = 'measure'", max_results=1000)
    print("| run | workload | config | drafts engine / replay | accepted engine / replay [upper] | accept length "
          "engine / replay | per-position engine | per-position replay | c1 step sequences exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        served = engine_config(run)
        if served is None:
            continue
        src = load_source(run.info.run_id, client)
        res = replay_workload(src.sequences, [served[0]], served[1])[served[0]]
        cmp = agreement(run, res | {"config": served[0], "max_model_len": served[1]}, src.sequences)
        m = run.data.metrics
        k = served[0].k
        eng_pos = " / ".join(f"{m.get(f'accept_pos_{i}', float('nan')):.3f}" for i in range(k))
        rep_pos = " / ".join(f"{cmp.get(f'replay_accept_pos_{i}', float('nan')):.3f}" for i in range(k))
        print(f"| {run.info.run_id[:8]} | {run.data.tags.get('specws.workload')} | {served[0].label} | "
              f"{int(m.get('spec_drafts', -1))} / {int(cmp['replay_drafts'])} | "
              f"{int(m.get('spec_accepted_tokens', -1))} / {int(cmp['replay_accepted'])} "
              f"[{int(cmp['replay_accepted_upper'])}] | {m.get('accept_length', float('nan')):.3f} / "
              f"{cmp.get('replay_accept_length', float('nan')):.3f} | {eng_pos} | {rep_pos} | "
              f"{cmp.get('c1_requests_step_sequence_exact', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
