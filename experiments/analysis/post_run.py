"""What the runner logs onto a measured run after the harness is done with it: the speedup model's prediction
(experiments/analysis/predict.py), per-category results with paired intervals against its baseline, the
per-request accept-length distribution, the contamination check, and per level the latency targets' rows and the
level's verdict (experiments/analysis/slo.py). Reads the run's metrics, config and records back from the store,
so it sees exactly what was recorded."""
from __future__ import annotations

from typing import TYPE_CHECKING

from experiments.analysis.categories import ALL, log_category_results
from experiments.analysis.predict import log_prediction
from experiments.analysis.runs import run_config
from experiments.analysis.slo import log_level_verdicts, slo_levels
from experiments.tracking.records import run_records

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


def log_run_analysis(client: MlflowClient, run_id: str, baseline: Run | None, engine: str) -> None:
    records = run_records(client, run_id) or []
    log_prediction(client, run_id, baseline, records)
    base = run_records(client, baseline.info.run_id) if baseline is not None else None
    rows, check = log_category_results(client, run_id, records, base, engine)
    if base is None:
        return
    config = run_config(client.get_run(run_id))
    throughput = {r["concurrency"]: r["verdict"] for r in rows if r["category"] == ALL}
    log_level_verdicts(client, run_id, throughput, slo_levels(records, base, config.slo_targets, config.closed),
                       check.flagged)
