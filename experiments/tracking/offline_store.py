"""A run store for hosts without MLflow or a reachable tracking server (the H200 host, a box without
network): the subset of `MlflowClient` the runner uses, written as plain files under one folder.
`python -m experiments.tracking.import_runs <folder or .tar.gz>` later logs those runs into the workspace's MLflow
store, keeping their order, metrics history, tags, artifacts and links between runs.

Layout: <root>/<run_id>/{run.json, metrics.jsonl, artifacts/...}; run.json holds experiment, name,
status, start/end times, params and tags.
"""
from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.tracking.records import read_jsonl

URI_PREFIX = "offline://"
_CLAUSE = re.compile(r"(tags|attributes|params)\.`?([\w.]+)`?\s*=\s*'([^']*)'")


@dataclass
class RunInfo:
    run_id: str
    experiment_id: str
    status: str
    start_time: int
    end_time: int | None = None
    run_name: str = ""


@dataclass
class RunData:
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class OfflineRun:
    info: RunInfo
    data: RunData


class OfflineClient:
    """Files instead of a tracking server; same method names and arguments as MlflowClient."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    # experiments: the name is the id
    def get_experiment_by_name(self, name: str) -> Any:
        return type("Experiment", (), {"experiment_id": name, "name": name})()

    def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
        return name

    def create_run(self, experiment_id: str, run_name: str | None = None,
                   tags: dict[str, str] | None = None, start_time: int | None = None) -> OfflineRun:
        run_id = uuid.uuid4().hex
        meta = {"run_id": run_id, "experiment": experiment_id, "run_name": run_name or run_id,
                "status": "RUNNING", "start_time": start_time or _now_ms(), "end_time": None,
                "params": {}, "tags": dict(tags or {}), "order": len(list(self.root.iterdir()))}
        (self.root / run_id / "artifacts").mkdir(parents=True)
        self._write(run_id, meta)
        return self.get_run(run_id)

    def get_run(self, run_id: str) -> OfflineRun:
        meta = self._read(run_id)
        latest: dict[str, float] = {}
        for row in self.metric_rows(run_id):
            latest[row["key"]] = row["value"]
        return OfflineRun(RunInfo(run_id, meta["experiment"], meta["status"], meta["start_time"],
                                  meta["end_time"], meta["run_name"]),
                          RunData(latest, dict(meta["params"]), dict(meta["tags"])))

    def search_runs(self, experiment_ids: list[str], filter_string: str = "", order_by: list[str] | None = None,
                    max_results: int = 1000) -> list[OfflineRun]:
        """Only conjunctions of `tags.x = 'v'`, `params.x = 'v'` and `attributes.status = 'v'`."""
        clauses = _CLAUSE.findall(filter_string)
        runs = [self.get_run(p.name) for p in self.root.iterdir() if (p / "run.json").exists()]
        runs = [r for r in runs if r.info.experiment_id in experiment_ids and all(_matches(r, c) for c in clauses)]
        runs.sort(key=lambda r: r.info.start_time, reverse=True)
        return runs[:max_results]

    def log_batch(self, run_id: str, metrics: list | None = None, params: list | None = None,
                  tags: list | None = None) -> None:
        meta = self._read(run_id)
        meta["params"].update({p.key: str(p.value) for p in params or []})
        meta["tags"].update({t.key: str(t.value) for t in tags or []})
        self._write(run_id, meta)
        for m in metrics or []:
            self.log_metric(run_id, m.key, m.value, getattr(m, "timestamp", None), getattr(m, "step", 0))

    def log_metric(self, run_id: str, key: str, value: float, timestamp: int | None = None, step: int = 0) -> None:
        with open(self.root / run_id / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"key": key, "value": float(value), "timestamp": timestamp or _now_ms(),
                                "step": int(step or 0)}) + "\n")

    def log_param(self, run_id: str, key: str, value: Any) -> None:
        meta = self._read(run_id)
        meta["params"][key] = str(value)
        self._write(run_id, meta)

    def set_tag(self, run_id: str, key: str, value: Any) -> None:
        meta = self._read(run_id)
        meta["tags"][key] = str(value)
        self._write(run_id, meta)

    def set_terminated(self, run_id: str, status: str = "FINISHED", end_time: int | None = None) -> None:
        meta = self._read(run_id)
        meta["status"], meta["end_time"] = status, end_time or _now_ms()
        self._write(run_id, meta)

    def log_dict(self, run_id: str, dictionary: Any, artifact_file: str) -> None:
        path = self._artifact_path(run_id, artifact_file)
        path.write_text(json.dumps(dictionary, indent=2, default=str))

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._artifact_path(run_id, artifact_file).write_text(text)

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        import matplotlib.pyplot as plt

        figure.savefig(self._artifact_path(run_id, artifact_file), dpi=110, bbox_inches="tight")
        plt.close(figure)

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        src = Path(local_path)
        dest = self.root / run_id / "artifacts" / (artifact_path or "")
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / src.name)

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        dest = self.root / run_id / "artifacts" / (artifact_path or "")
        shutil.copytree(local_dir, dest, dirs_exist_ok=True)

    def download_artifacts(self, run_id: str, path: str, dst_path: str | None = None) -> str:
        src = self.root / run_id / "artifacts" / path
        if not src.exists():
            raise FileNotFoundError(f"run {run_id} has no artifact {path!r}")
        return str(src)

    # helpers for the importer
    def run_ids(self) -> list[str]:
        """Runs in creation order (parents before children, baselines before the options paired with them)."""
        metas = [self._read(p.name) for p in self.root.iterdir() if (p / "run.json").exists()]
        return [m["run_id"] for m in sorted(metas, key=lambda m: (m["start_time"], m["order"]))]

    def metric_rows(self, run_id: str) -> list[dict]:
        path = self.root / run_id / "metrics.jsonl"
        return read_jsonl(path) if path.exists() else []

    def meta(self, run_id: str) -> dict:
        return self._read(run_id)

    def _artifact_path(self, run_id: str, artifact_file: str) -> Path:
        path = self.root / run_id / "artifacts" / artifact_file
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _read(self, run_id: str) -> dict:
        path = self.root / run_id / "run.json"
        if not path.exists():
            raise KeyError(f"no run {run_id} in the offline store {self.root}")
        return json.loads(path.read_text())

    def _write(self, run_id: str, meta: dict) -> None:
        tmp = self.root / run_id / "run.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(self.root / run_id / "run.json")


def client_for(uri: str) -> Any:
    """The store's client: this offline store for an `offline://<folder>` URI (no MLflow needed), else MLflow's for
    the URI (MLflow's tracking URI set to it)."""
    if uri.startswith(URI_PREFIX):
        return OfflineClient(uri.removeprefix(URI_PREFIX))
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(uri)
    return MlflowClient()


def _matches(run: OfflineRun, clause: tuple[str, str, str]) -> bool:
    kind, key, value = clause
    if kind == "attributes":
        return str(getattr(run.info, key, "")) == value
    return (run.data.tags if kind == "tags" else run.data.params).get(key) == value


def _now_ms() -> int:
    return int(time.time() * 1000)
