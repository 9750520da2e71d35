"""`python -m experiments.eagle3.curve_run HEAD [HEAD ...] --experiment NAME [--tracking-uri URI]`: a head trained
by `experiments.eagle3.gpu` (on a GPU host, with no MLflow there) as a `D-train` MLflow run, as the CPU trainer logs
its own: the training curve (`train_curve.jsonl`: train/loss, train/lr, train/acc_k every step; val/acc_k,
val/loss_k, val/accept_length_est_k at each validation) as metric histories, the summary (`specws_eagle3.json`) as
`final/*` metrics and params, and both files as artifacts. HEAD is a folder with those two files (a head as the
trainer writes it and `bin/h200 head` brings back, or a journal folder); run it where MLflow is installed."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.tracking.console_guard import quiet_console
from experiments.tracking.import_runs import DEFAULT_URI, default_artifact_root, experiment_for
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.offline_store import client_for
from experiments.tracking.redact import register_secrets, secrets_of_environ
from experiments.tracking.redacting import RedactingClient

CURVE, SUMMARY = "train_curve.jsonl", "specws_eagle3.json"
BATCH = 1000                    # metrics per log_batch call (MLflow's limit)
PARAM_KEYS = ("data", "data_key", "steps", "train_sequences", "val_sequences", "train_answer_tokens", "device",
              "max_new_tokens", "target")


class NotAHead(ValueError):
    """A folder without the trainer's summary and curve."""


def read_curve(folder: Path) -> list[dict]:
    """The curve's rows ({name, value, step}), in the order the trainer wrote them."""
    path = folder / CURVE
    if not (path.is_file() and (folder / SUMMARY).is_file()):
        raise NotAHead(f"{folder}: needs {SUMMARY} and {CURVE} (a head from experiments.eagle3.gpu)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / SUMMARY).read_text())


def params_of(summary: dict[str, Any]) -> dict[str, str]:
    params = {f"train.{k}": str(summary[k]) for k in PARAM_KEYS if k in summary}
    share = summary.get("train_share") or {}
    params["train.train_fraction"] = str(share.get("train_fraction", 1.0))
    params.update({f"train.settings.{k}": str(v) for k, v in (summary.get("settings") or {}).items()})
    return params


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    return {f"final/{k}": float(v) for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def _batches(rows: list[dict]) -> Iterator[list]:
    from mlflow.entities import Metric

    stamp = 0
    for i in range(0, len(rows), BATCH):
        yield [Metric(r["name"], float(r["value"]), stamp, int(r["step"])) for r in rows[i:i + BATCH]]


def log_head(client: Any, exp_id: str, folder: Path, rows: list[dict], name: str = "D-train") -> str:
    """One run for the head in `folder`, whose curve is `rows` (read_curve); returns its id."""
    summary = summary_of(folder)
    tags = {"specws.mode": "train", "specws.option": "D", "specws.head_folder": folder.name,
            "specws.trained_on": str(summary.get("device", "?"))}
    with tracked_run(client, exp_id, name, tags, params_of(summary), system_metrics=False) as run:
        for batch in _batches(rows):
            client.log_batch(run.id, metrics=batch)
        for key, value in final_metrics(summary).items():
            client.log_metric(run.id, key, value)
        for file in (CURVE, SUMMARY):
            client.log_artifact(run.id, str(folder / file), "head")
    return run.id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.eagle3.curve_run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", type=Path, nargs="+", help="head folders (specws_eagle3.json + train_curve.jsonl)")
    ap.add_argument("--experiment", required=True, help="e.g. smollm2_135m@h200 (the served runs' experiment)")
    ap.add_argument("--tracking-uri", default=DEFAULT_URI)
    ap.add_argument("--name", default="D-train", help="run name (one per head)")
    a = ap.parse_args(argv)
    try:
        curves = {folder: read_curve(folder) for folder in a.heads}   # every head checked before anything is written
    except NotAHead as exc:
        ap.error(str(exc))
    quiet_console()
    register_secrets(secrets_of_environ(os.environ))
    client = RedactingClient(client_for(a.tracking_uri))
    exp_id = experiment_for(client, a.experiment, default_artifact_root(a.tracking_uri))
    for folder, rows in curves.items():
        run_id = log_head(client, exp_id, folder, rows, a.name)
        print(f"MLflow run {a.name} ({run_id}) in {a.experiment}: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
