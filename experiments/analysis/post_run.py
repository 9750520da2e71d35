"""What the runner logs onto a measured run after the harness is done with it: the speedup model's prediction
(experiments/analysis/predict.py), per-category results with paired intervals against its baseline, the
per-request accept-length distribution, and the contamination check. Reads the run's metrics, config and records
back from the store, so it sees exactly what was recorded."""
from __future__ import annotations

from typing import TYPE_CHECKING

from experiments.analysis.categories import log_category_results
from experiments.analysis.predict import log_prediction
from experiments.tracking.records import run_records

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


def log_run_analysis(client: MlflowClient, run_id: str, baseline: Run | None, engine: str) -> None:
    records = run_records(client, run_id) or []
    log_prediction(client, run_id, baseline, records)
    base = run_records(client, baseline.info.run_id) if baseline is not None else None
    log_category_results(client, run_id, records, base, engine)
