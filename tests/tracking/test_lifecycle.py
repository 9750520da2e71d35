"""A run's terminal state survives a failing store: a real MLflow SQLite store, locked by a second connection that
holds an exclusive transaction (MLflow waits 20 s per write before giving up, so these tests wait too)."""
from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from conftest import compose_cfg
from mlflow.tracking import MlflowClient

from experiments.config.views import tracking_view
from experiments.tracking import runs
from experiments.tracking.lifecycle import (
    FAILURE_TAG,
    NOTE_TAG,
    OPTIONS_TAG,
    StoreUnavailable,
    pending_dir,
    tracked_run,
)

MLFLOW_BUSY_S = 20   # MLflow's `PRAGMA busy_timeout` for SQLite


def locked(db: Path) -> sqlite3.Connection:
    """A second connection holding an exclusive transaction: no other connection reads or writes until it ends."""
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN EXCLUSIVE")
    return conn


@pytest.fixture
def mlflow_store(tmp_path: Path):
    """The workspace's store setup on a fresh SQLite file: (client, experiment id, config, db path)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose_cfg("+option=A", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path / 'artifacts'}")
    client, exp_id = runs.setup(tracking_view(cfg))
    return client, exp_id, cfg, tmp_path / "mlflow.db"


def test_a_store_locked_past_mlflows_own_wait_still_gets_the_runs_end(mlflow_store) -> None:
    client, exp_id, _, db = mlflow_store
    with tracked_run(client, exp_id, "locked-at-the-end", {}) as run:
        lock = locked(db)
        threading.Timer(MLFLOW_BUSY_S + 5, lock.rollback).start()   # the store comes back after 25 s
    assert client.get_run(run.id).info.status == "FINISHED"


@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_a_store_that_stays_locked_leaves_the_end_on_disk_for_the_next_start(mlflow_store, ending) -> None:
    client, exp_id, cfg, db = mlflow_store
    lock = None
    started = time.monotonic()
    expected = StoreUnavailable if ending == "finished" else ValueError
    with pytest.raises(expected) as raised:
        with tracked_run(client, exp_id, f"locked-{ending}", {}, store_retry_s=0) as run:
            lock = locked(db)
            if ending == "failed":
                raise ValueError("the measurement failed")
    assert time.monotonic() - started < MLFLOW_BUSY_S + 15
    if ending == "finished":   # a clear error that says where the end went
        assert f"could not record run {run.id} FINISHED" in str(raised.value)
        assert str(pending_dir(client.tracking_uri)) in str(raised.value)
    lock.rollback()
    assert client.get_run(run.id).info.status == "RUNNING"       # the store never took it...
    runs._checked_for_stale.clear()
    runs.setup(tracking_view(cfg))                                # ...the next start records it, reason kept
    after = client.get_run(run.id)
    assert after.info.status == ("FINISHED" if ending == "finished" else "FAILED")
    if ending == "failed":
        assert after.data.tags[FAILURE_TAG] == "ValueError: the measurement failed"
    assert not list(pending_dir(client.tracking_uri).glob("*.json"))


def test_a_store_that_cannot_create_the_run_is_a_clear_error(mlflow_store) -> None:
    client, exp_id, _, db = mlflow_store
    lock = locked(db)
    try:
        with pytest.raises(StoreUnavailable, match="could not create run 'never'.*nothing was started"):
            with tracked_run(client, exp_id, "never", {}):
                pytest.fail("the body of a run the store did not create ran")
    finally:
        lock.rollback()
    assert MlflowClient(client.tracking_uri).search_runs([exp_id]) == []


def test_the_experiment_says_what_it_holds_once_per_option_and_keeps_a_description_of_its_own(mlflow_store,
                                                                                            tmp_path) -> None:
    client, exp_id, _, _ = mlflow_store
    tags = {"specws.model": "smollm2_135m", "specws.site": "local", "specws.mode": "measure"}
    for option in ("A", "baseline", "A"):
        with tracked_run(client, exp_id, option, tags | {"specws.option": option}):
            pass
    with tracked_run(client, exp_id, "report", tags | {"specws.option": "C", "specws.mode": "report"}):
        pass   # a report names no option it measured
    exp = client.get_experiment(exp_id)
    note = exp.tags[NOTE_TAG]
    assert exp.tags[OPTIONS_TAG] == "baseline,A"
    assert note.startswith(f"**{exp.name}**: speculative-decoding measurements of smollm2_135m served on site local")
    assert "Options measured: baseline, A." in note and "Verdict: ..." in note
    # an experiment someone described themselves keeps its description
    other = client.create_experiment("described", artifact_location=str(tmp_path / "described"))
    client.set_experiment_tag(other, NOTE_TAG, "my own words")
    with tracked_run(client, other, "A", tags | {"specws.option": "A"}):
        pass
    assert client.get_experiment(other).tags[NOTE_TAG] == "my own words"
