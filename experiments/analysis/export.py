"""`python -m experiments.analysis.export <experiment> [--tracking-uri URI] [--out DIR]`: an experiment's runs as
plain tables for work outside the workspace (pandas, DuckDB, a spreadsheet):

- `levels.csv`, `levels.parquet`: one row per run x concurrency level -- the run (id, name, status, start time,
  option, site, model, workload, mode, parent and paired baseline), its `spec.*` params, the level's concurrency
  and every metric the run logged for that level (`<name>_c<concurrency>`, as `<name>`);
- `records.parquet`: every request record of those runs (the `records/` artifacts), with the run's id and option.

The store is `--tracking-uri`, else MLFLOW_TRACKING_URI, else the workspace's SQLite store; a run without per-level
metrics (a dry run, a sweep parent) has no rows. Mapping fields of a record (an engine's `meta`) are kept as JSON
text, since their keys differ between engines.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from experiments.config.paths import ROOT
from experiments.tracking.records import run_records

LEVEL_METRIC = re.compile(r"^(?P<name>.+)_c(?P<concurrency>\d+)$")
RUN_TAGS = {"option": "specws.option", "site": "specws.site", "model": "specws.model", "workload": "specws.workload",
            "mode": "specws.mode", "parent_run_id": "mlflow.parentRunId", "baseline_run_id": "specws.baseline_run_id"}


@dataclass
class Exported:
    runs: int
    levels: int
    records: int
    files: list[Path]


def _value(text: str) -> Any:
    """A flattened param as its value: "None" is null, numbers are numbers, the rest stays text."""
    if text == "None":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def level_rows(run: Any) -> list[dict]:
    """One row per concurrency level the run has metrics for, lowest first."""
    levels: dict[int, dict[str, float]] = {}
    for key, value in run.data.metrics.items():
        if (m := LEVEL_METRIC.match(key)) is not None:
            levels.setdefault(int(m["concurrency"]), {})[m["name"]] = value
    base = {"run_id": run.info.run_id, "run_name": run.data.tags.get("mlflow.runName", run.info.run_name),
            "status": run.info.status, "start_time": pd.Timestamp(run.info.start_time, unit="ms", tz="UTC"),
            **{column: run.data.tags.get(tag) for column, tag in RUN_TAGS.items()},
            **{k: _value(v) for k, v in sorted(run.data.params.items()) if k.startswith("spec.")}}
    return [{**base, "concurrency": c, **metrics} for c, metrics in sorted(levels.items())]


def levels_table(runs: list) -> pd.DataFrame:
    rows = [row for run in runs for row in level_rows(run)]
    frame = pd.DataFrame(rows)
    for column in frame.select_dtypes(include="object").columns:   # mixing numbers and text: written as text
        kinds = {type(v) for v in frame[column] if v is not None and not pd.isna(v)}
        if len(kinds) > 1 and not kinds <= {int, float}:
            frame[column] = [None if v is None or pd.isna(v) else str(v) for v in frame[column]]
    return frame


def records_table(client: Any, runs: list) -> pa.Table | None:
    """Every record of `runs`, with its run's id and option; None when none of them has records."""
    rows = []
    for run in runs:
        for record in run_records(client, run.info.run_id) or []:
            rows.append({"run_id": run.info.run_id, "option": run.data.tags.get("specws.option"), **record})
    if not rows:
        return None
    names = list(dict.fromkeys(k for row in rows for k in row))
    return pa.table({name: _column([row.get(name) for row in rows]) for name in names})


def _column(values: list) -> pa.Array:
    """Values as Arrow infers them; mappings, and a column Arrow cannot type as one, as JSON text."""
    if not any(isinstance(v, dict) for v in values):
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
    return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values],
                    type=pa.string())


def export(client: Any, experiment: str, out: Path) -> Exported:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise SystemExit(f"no experiment {experiment!r} in the store; it has: {', '.join(names) or 'none'}")
    runs = client.search_runs([exp.experiment_id], max_results=50000, order_by=["attributes.start_time ASC"])
    measured = [run for run in runs if level_rows(run)]
    out.mkdir(parents=True, exist_ok=True)
    levels = levels_table(measured)
    files = [out / "levels.csv", out / "levels.parquet"]
    levels.to_csv(files[0], index=False)
    levels.to_parquet(files[1], index=False)
    records = records_table(client, measured)
    if records is not None:
        files.append(out / "records.parquet")
        pq.write_table(records, files[-1])
    return Exported(len(measured), len(levels), records.num_rows if records is not None else 0, files)


def main(argv: list[str] | None = None) -> int:
    import mlflow
    from mlflow.tracking import MlflowClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", help="experiment name, e.g. smollm2_135m@local")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI")
                    or f"sqlite:///{ROOT / 'mlruns' / 'mlflow.db'}")
    ap.add_argument("--out", type=Path, default=None, help="default: mlruns/exports/<experiment>")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "mlruns" / "exports" / args.experiment.replace("/", "_")
    mlflow.set_tracking_uri(args.tracking_uri)
    done = export(MlflowClient(args.tracking_uri), args.experiment, out)
    print(f"{done.runs} runs, {done.levels} run x level rows, {done.records} records -> "
          f"{', '.join(str(f) for f in done.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
