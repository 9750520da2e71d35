"""Writes a tracking store could not take, kept on this machine until it can: once a write of a run fails because
the store itself failed -- an http(s) tracking server that cannot be reached (refused or dropped connections,
timeouts, 5xx answers after MLflow's own retries), or a SQLite store that is locked past MLflow's wait, damaged,
read-only or on a full disk -- that write and every later one of the run (metrics, params, tags, artifacts, dataset
inputs, its end) go to a spool folder in the offline store's layout (experiments.tracking.offline_store) instead,
and the run's measurement goes on. The next run on the same tracking URI records them once the store is usable
(experiments.tracking.runs.setup), or `python -m experiments.tracking.spool [--tracking-uri URI]` does.

A run still being spooled by a live process is left alone; a spool whose writer died without ending the run is
recorded as far as it goes (the run is then failed as stale, experiments.tracking.lifecycle.fail_stale_runs).
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import inspect
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from experiments.config.paths import cache_dir
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.processes import same_process
from experiments.tracking.records import read_jsonl
from experiments.tracking.redact import redact_text
from experiments.tracking.store import log_inputs, log_params, sqlite_file

console = Console(stderr=True)
WRITES = ("log_batch", "log_metric", "log_param", "set_tag", "set_terminated", "log_dict", "log_text", "log_figure",
          "log_artifact", "log_artifacts", "log_inputs")
# A SQLite store's failing end (locked by another runner, mostly) is the lifecycle's to retry and keep on disk
# (tracking.lifecycle); a run's data, or an end that follows data already spooled, goes to the spool.
END_WRITES = ("set_tag", "set_terminated")


class ServerUnreachable(RuntimeError):
    """A read of a run whose writes are being spooled: the server is known to be unreachable, and lacks them."""


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def spools(uri: str) -> bool:
    """Whether a run's writes to the store of `uri` go to the spool once the store fails: a tracking server or a
    SQLite file (an offline store is plain files, a file store has nothing to fall back on)."""
    return is_remote(uri) or sqlite_file(uri) is not None


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) says the store failed, not the write: a server that could not
    be reached (a connection error, a timeout, retries exhausted, a 5xx answer; a 4xx answer is the server refusing
    the write), or a database that could not be used (locked, damaged, read-only, full; not a constraint that the
    write broke)."""
    import requests

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, requests.exceptions.HTTPError):
            return exc.response is None or exc.response.status_code >= 500
        if isinstance(exc, requests.exceptions.RequestException) or _database_failed(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _database_failed(exc: BaseException) -> bool:
    """SQLite's (or SQLAlchemy's account of its) OperationalError, or a DatabaseError that is not about the
    statement ("database disk image is malformed", "file is not a database")."""
    import sqlite3

    import sqlalchemy.exc as sa

    if isinstance(exc, sqlite3.OperationalError | sa.OperationalError):
        return True
    statement = (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.DataError, sqlite3.NotSupportedError,
                 sa.IntegrityError, sa.ProgrammingError, sa.DataError, sa.NotSupportedError)
    return isinstance(exc, sqlite3.DatabaseError | sa.DatabaseError) and not isinstance(exc, statement)


def spool_root(uri: str) -> Path:
    """This machine's spool for one tracking URI."""
    return cache_dir() / "spool" / hashlib.sha256(uri.encode()).hexdigest()[:16]


class SpoolingClient:
    """Wraps an MlflowClient of an http(s) or SQLite URI: a run's writes go to the spool from its first write that
    finds the store failed on; reads of that run then fail at once (ServerUnreachable); all else is forwarded."""

    def __init__(self, client: Any, uri: str) -> None:
        self._client, self._uri = client, uri
        self._spool = spool_root(uri)
        self._spooling: set[str] = set()
        self._starters = WRITES if is_remote(uri) else tuple(w for w in WRITES if w not in END_WRITES)

    @property
    def wrapped(self) -> Any:
        return self._client

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return self._writer(name, attr) if name in WRITES else self._reader(attr)

    def _reader(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def call(*args, **kwargs):
            run_id = args[0] if args else kwargs.get("run_id")
            if isinstance(run_id, str) and run_id in self._spooling:
                raise ServerUnreachable(f"run {run_id} is being spooled to {self._spool / run_id}: "
                                        f"the tracking store {redact_text(self._uri)} failed")
            return method(*args, **kwargs)
        return call

    def _writer(self, name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def call(*args, **kwargs):
            run_id = args[0] if args else kwargs.get("run_id")
            if run_id not in self._spooling:
                try:
                    return method(*args, **kwargs)
                except Exception as exc:
                    if not isinstance(run_id, str) or name not in self._starters or not unreachable(exc):
                        raise
                    self._start(run_id, exc)
            return self._write(name, inspect.signature(method).bind(*args, **kwargs))
        return call

    def _start(self, run_id: str, exc: BaseException) -> None:
        folder = self._spool / run_id
        (folder / "artifacts").mkdir(parents=True, exist_ok=True)
        if not (folder / "run.json").exists():
            _write_json(folder / "run.json", {"run_id": run_id, "experiment": "", "run_name": run_id,
                                              "status": "RUNNING", "start_time": _now_ms(), "end_time": None,
                                              "params": {}, "tags": {}, "order": 0})
        me = psutil.Process()
        reason = redact_text(f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        _write_json(folder / "spool.json", {"uri": redact_text(self._uri), "pid": me.pid,
                                            "pid_start": me.create_time(), "host": platform.node(),
                                            "since": _now_ms(), "reason": reason})
        self._spooling.add(run_id)
        store = redact_text(self._uri)
        failed = f"the tracking server {store} is unreachable" if is_remote(self._uri) else \
            f"the tracking store {store} failed"
        console.print(f"[bold red]{failed}[/] ({reason}); run {run_id}'s writes are kept in {folder}: the next run "
                      f"on this store records them once it is usable, or "
                      f"`python -m experiments.tracking.spool --tracking-uri {store}`")

    def _write(self, name: str, bound: inspect.BoundArguments) -> None:
        bound.apply_defaults()
        args = dict(bound.arguments)
        run_id = args["run_id"]
        if name == "log_inputs":
            with open(self._spool / run_id / "inputs.jsonl", "a") as f:
                for dataset in args.get("datasets") or []:
                    f.write(json.dumps(dataset.to_dictionary()) + "\n")
            return
        if name == "set_terminated":
            args["status"] = args.get("status") or "FINISHED"
        target = getattr(OfflineClient(self._spool), name)
        accepted = inspect.signature(target).parameters
        target(**{k: v for k, v in args.items() if k in accepted})


def apply_spooled(client: Any, uri: str) -> list[str]:
    """Record every spooled run of `uri` on this machine through `client` (a plain MlflowClient: a failure here
    must raise, not spool again), oldest first; each spool is removed once recorded. Returns the run ids."""
    root = spool_root(uri)
    if not root.is_dir():
        return []
    done = []
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # two runners starting at once record a spool once
        for folder in sorted(_spools(root), key=lambda f: _owner(f).get("since", 0)):
            if not (folder / "run.json").exists():
                continue   # recorded by the runner that held the lock before
            meta, owner = OfflineClient(root).meta(folder.name), _owner(folder)
            if meta["status"] == "RUNNING" and same_process(owner.get("pid", -1), owner.get("pid_start", 0)):
                console.print(f"run {folder.name} is still being spooled by pid {owner['pid']}: left for later")
                continue
            try:
                _replay(client, root, meta)
            except Exception as exc:  # noqa: BLE001 - the server failing again, or the run gone from it
                console.print(f"[yellow]kept the spooled writes of run {folder.name} in {folder}[/]: {exc}")
                continue
            shutil.rmtree(folder)
            done.append(folder.name)
    if done:
        console.print(f"recorded the spooled writes of {len(done)} run(s) the tracking server could not take "
                      f"earlier: {', '.join(done)}")
    return done


def _spools(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir() and (p / "run.json").exists()]


def _owner(folder: Path) -> dict:
    try:
        return json.loads((folder / "spool.json").read_text())
    except (OSError, ValueError):
        return {}


def _replay(client: Any, root: Path, meta: dict) -> None:
    """A spool's writes, each of which MLflow takes again unchanged (so a replay cut short can run again):
    params, metrics, tags, artifacts, dataset inputs, then the end."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, RunTag

    run_id, folder = meta["run_id"], root / meta["run_id"]
    if meta["params"]:
        log_params(client, run_id, meta["params"])
    rows = [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in OfflineClient(root).metric_rows(run_id)]
    for start in range(0, len(rows), 1000):
        client.log_batch(run_id, metrics=rows[start:start + 1000])
    tags = [RunTag(k, v) for k, v in meta["tags"].items()]
    for start in range(0, len(tags), 100):
        client.log_batch(run_id, tags=tags[start:start + 100])
    if any((folder / "artifacts").iterdir()):
        client.log_artifacts(run_id, str(folder / "artifacts"))
    if (folder / "inputs.jsonl").exists():   # DatasetInput.from_dictionary leaves its parts as dicts
        inputs = [DatasetInput(Dataset.from_dictionary(d["dataset"]), [InputTag(k, v) for k, v in d["tags"].items()])
                  for d in read_jsonl(folder / "inputs.jsonl")]
        log_inputs(client, run_id, inputs)
    if meta["status"] != "RUNNING":
        client.set_terminated(run_id, meta["status"], end_time=meta["end_time"])


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _now_ms() -> int:
    return int(time.time() * 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Record the writes this machine spooled while a tracking store failed "
                                             "(runs start doing it by themselves).")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                    help="the store's URI (default: MLFLOW_TRACKING_URI)")
    args = ap.parse_args(argv)
    if not args.tracking_uri or not spools(args.tracking_uri):
        ap.error("give the tracking server's http(s) URI or the sqlite:/// store (--tracking-uri or "
                 "MLFLOW_TRACKING_URI)")
    from mlflow.tracking import MlflowClient

    done = apply_spooled(MlflowClient(args.tracking_uri), args.tracking_uri)
    root = spool_root(args.tracking_uri)
    left = _spools(root) if root.is_dir() else []
    print(f"{len(done)} run(s) recorded in {redact_text(args.tracking_uri)}; {len(left)} left in {root}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
