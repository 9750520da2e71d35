"""tracking=server against a real `mlflow server` on PostgreSQL with proxied artifacts (tests/helpers/
tracking_server.py): runs, artifacts and datasets through it; experiments created by runners at once; a server that
goes away mid-run (the run's writes spooled, recorded by the next runner or the recovery command); a refusal that
is not spooled; the offline importer into it, links kept. The runners against it: test_server_e2e.py."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import compose_cfg
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from experiments.config.errors import Refused
from experiments.config.paths import ROOT
from experiments.config.views import tracking_view, typed_run
from experiments.tracking import runs, spool
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.runs import open_run, setup
from experiments.tracking.store import log_prompt_dataset
from experiments.tracking.store_check import check_tracking
from tests.helpers.tracking_server import FAST_GIVE_UP, kill_mlflow, restart_mlflow, running_tracking_server


@pytest.fixture(scope="module")
def server():
    with running_tracking_server() as s:
        yield s


def server_cfg(uri: str, experiment: str):
    return compose_cfg("+option=baseline", "tracking=server", f"tracking.uri={uri}",
                       f"tracking.experiment={experiment}")


def test_a_run_its_artifacts_and_dataset_go_through_the_server(server) -> None:
    cfg = server_cfg(server.uri, "through")
    with open_run(typed_run(cfg), "measure", "one") as run:
        run.client.log_metric(run.id, "output_tok_s", 12.5)
        run.client.log_dict(run.id, {"ok": True}, "summary.json")
        log_prompt_dataset(run.client, run.id, "smoke", "grounded", [{"id": "p1", "text": "hi"}], "d" * 40)
    stored = MlflowClient(server.uri).get_run(run.id)
    assert stored.info.status == "FINISHED" and stored.data.metrics["output_tok_s"] == 12.5
    assert stored.data.params["tracking.uri"] == server.uri
    assert stored.info.artifact_uri.startswith("mlflow-artifacts:/")    # proxied: no client writes the folder
    on_disk = list((server.folder / "artifacts").rglob("summary.json"))
    assert len(on_disk) == 1 and json.loads(on_disk[0].read_text()) == {"ok": True}
    (dataset,) = stored.inputs.dataset_inputs
    assert dataset.dataset.name == "smoke" and dataset.dataset.digest == "d" * 36


def test_runners_creating_the_experiment_at_once_all_get_it(server) -> None:
    cfg = server_cfg(server.uri, "created-at-once")
    client = MlflowClient(server.uri)
    start, ids, errors = threading.Barrier(6), [], []

    def runner() -> None:
        start.wait()
        try:
            ids.append(runs._experiment_id(client, tracking_view(cfg)))
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=runner) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(ids) == 6 and len(set(ids)) == 1


def _log_dataset_at_once(client: MlflowClient, run_ids: list[str], digest: str) -> list[Exception]:
    start, errors = threading.Barrier(len(run_ids)), []

    def runner(run_id: str) -> None:
        start.wait()
        try:
            log_prompt_dataset(client, run_id, "smoke", "grounded", [{"id": "p1", "text": "hi"}], digest)
        except Exception as exc:  # noqa: BLE001 - collected, asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=runner, args=(r,)) for r in run_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_runners_logging_one_new_prompt_set_at_once_all_record_it(server) -> None:
    """The server looks a dataset up and inserts it if missing: runners starting on the same new prompt set at once
    collide on its unique key (CI saw it with two runners); each run still ends with the one dataset as its input."""
    client = MlflowClient(server.uri)
    exp = runs._experiment_id(client, tracking_view(server_cfg(server.uri, "one-prompt-set")))
    for round_ in range(4):   # a new digest each round: a new row to race for
        run_ids = [client.create_run(exp).info.run_id for _ in range(6)]
        errors = _log_dataset_at_once(client, run_ids, f"{round_}" * 40)
        assert errors == []
        inputs = {r: client.get_run(r).inputs.dataset_inputs for r in run_ids}
        assert all(len(i) == 1 and i[0].dataset.digest == f"{round_}" * 36 for i in inputs.values())


@pytest.fixture(scope="module")
def outage(server, tmp_path_factory) -> dict:
    """One outage of the MLflow server, seen by three runs of this process: `done` writes metrics, a tag, the
    records and a dict while the server is gone and ends; `live` writes a metric and stays open; `died` writes a
    metric and then looks like a runner that was SIGKILLed. The server comes back; a new runner starts (setup);
    `live` ends; the recovery command runs. What each step left is kept for the tests below."""
    seen: dict = {}
    records = tmp_path_factory.mktemp("outage") / "records-x.jsonl"
    records.write_text('{"prompt_id": "p1"}\n{"prompt_id": "p2"}\n')
    cfg = server_cfg(server.uri, "outage")
    with pytest.MonkeyPatch.context() as env:
        for key, value in FAST_GIVE_UP.items():
            env.setenv(key, value)
        client, exp_id = setup(tracking_view(cfg))
        opened = {n: tracked_run(client, exp_id, n, {"specws.option": "baseline"}, {"spec.method": "none"})
                  for n in ("done", "live", "died")}
        ids = seen["ids"] = {n: cm.__enter__().id for n, cm in opened.items()}
        for run_id in ids.values():
            client.log_metric(run_id, "before", 1.0)
        kill_mlflow(server)
        try:
            _write_while_gone(client, ids, records, seen)
            opened["done"].__exit__(None, None, None)     # its end: spooled as well
            seen["done_spool"] = json.loads((spool.spool_root(server.uri) / ids["done"] / "run.json").read_text())
        finally:
            restart_mlflow(server)
        _as_if_killed(MlflowClient(server.uri), server.uri, ids["died"])
        seen["before_next_runner"] = {n: MlflowClient(server.uri).get_run(i).info.status for n, i in ids.items()}
        runs._checked_for_stale.clear()    # what a new runner process starts with
        setup(tracking_view(cfg))
        seen["after_next_runner"] = {n: MlflowClient(server.uri).get_run(i) for n, i in ids.items()}
        seen["live_spool_kept"] = (spool.spool_root(server.uri) / ids["live"]).exists()
        opened["live"].__exit__(None, None, None)
        seen["recovery_rc"] = spool.main(["--tracking-uri", server.uri])
    seen["records"], seen["uri"] = records, server.uri
    return seen


def _write_while_gone(client, ids: dict, records: Path, seen: dict) -> None:
    client.log_metric(ids["done"], "output_tok_s", 20.0)        # the first write that finds the server gone
    client.set_tag(ids["done"], "specws.records_path", str(records))
    client.log_artifact(ids["done"], str(records), "records")
    client.log_dict(ids["done"], {"requests": 2}, "summary.json")
    log_prompt_dataset(client, ids["done"], "smoke", "grounded", [{"id": "p1", "text": "hi"}], "e" * 40)
    try:
        client.get_run(ids["done"])
    except spool.ServerUnreachable as exc:                       # the server lacks what was spooled
        seen["read_refused"] = str(exc)
    client.log_metric(ids["live"], "output_tok_s", 4.0)
    client.log_metric(ids["died"], "output_tok_s", 5.0)


def _as_if_killed(client: MlflowClient, uri: str, run_id: str) -> None:
    """The run and its spool as a runner that was SIGKILLed leaves them: its process is gone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    client.set_tag(run_id, "specws.runner", f"{gone.pid}:0.00")
    owner = spool.spool_root(uri) / run_id / "spool.json"
    owner.write_text(json.dumps({**json.loads(owner.read_text()), "pid": gone.pid, "pid_start": 0.0}))


def test_while_the_server_is_gone_the_writes_and_the_end_are_kept_on_disk(outage) -> None:
    kept = outage["done_spool"]
    assert kept["status"] == "FINISHED" and kept["tags"]["specws.records_path"] == str(outage["records"])
    assert "is being spooled" in outage["read_refused"]
    assert outage["before_next_runner"] == {"done": "RUNNING", "live": "RUNNING", "died": "RUNNING"}


def test_the_next_runner_records_a_finished_spool(outage, tmp_path) -> None:
    got = outage["after_next_runner"]["done"]
    assert got.info.status == "FINISHED" and got.info.end_time == outage["done_spool"]["end_time"]
    assert got.data.metrics == {"before": 1.0, "output_tok_s": 20.0}
    assert got.data.tags["specws.records_path"] == str(outage["records"])
    back = MlflowClient(outage["uri"]).download_artifacts(got.info.run_id, "records/records-x.jsonl", str(tmp_path))
    assert Path(back).read_text() == outage["records"].read_text()
    (dataset,) = MlflowClient(outage["uri"]).get_run(got.info.run_id).inputs.dataset_inputs
    assert dataset.dataset.name == "smoke" and dataset.dataset.digest == "e" * 36


def test_a_spool_still_written_is_left_then_the_recovery_command_records_it(outage) -> None:
    assert outage["after_next_runner"]["live"].info.status == "RUNNING" and outage["live_spool_kept"]
    assert outage["recovery_rc"] == 0
    got = MlflowClient(outage["uri"]).get_run(outage["ids"]["live"])
    assert got.info.status == "FINISHED" and got.data.metrics["output_tok_s"] == 4.0
    assert not any(spool.spool_root(outage["uri"]).glob("*/run.json"))


def test_a_spool_whose_runner_died_is_recorded_then_the_run_failed_as_stale(outage) -> None:
    got = outage["after_next_runner"]["died"]
    assert got.data.metrics["output_tok_s"] == 5.0 and got.info.status == "FAILED"
    assert "ended without closing it" in got.data.tags["specws.failure"]


def test_a_write_the_server_refuses_is_raised_not_spooled(server) -> None:
    cfg = server_cfg(server.uri, "refused")
    client, exp_id = setup(tracking_view(cfg))
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        with tracked_run(client, exp_id, "refused", {}, {"spec.method": "none"}) as run:
            client.log_param(run.id, "spec.method", "ngram")
    assert not (spool.spool_root(server.uri) / run.id).exists()
    assert MlflowClient(server.uri).get_run(run.id).info.status == "FAILED"


def sweep_store(root: Path) -> dict[str, str]:
    """An offline sweep as a host without MLflow records it: a parent, two children, one paired with the other."""
    c = OfflineClient(root)
    parent = c.create_run("imported", "sweep-A", {"specws.sweep": "parent"}).info.run_id
    base = c.create_run("imported", "baseline", {"mlflow.parentRunId": parent, "specws.option": "baseline"})
    opt = c.create_run("imported", "A", {"mlflow.parentRunId": parent, "specws.option": "A",
                                         "specws.baseline_run_id": base.info.run_id})
    for run, tok_s in ((base, 10.0), (opt, 15.0)):
        c.log_metric(run.info.run_id, "output_tok_s", tok_s)
        c.log_text(run.info.run_id, '{"prompt_id": "p1"}\n', f"records/records-{run.info.run_id}.jsonl")
        c.set_terminated(run.info.run_id, "FINISHED")
    c.set_terminated(parent, "FINISHED")
    return {"parent": parent, "baseline": base.info.run_id, "A": opt.info.run_id}


def test_the_importer_keeps_parent_child_and_baseline_links_on_the_server(server, tmp_path) -> None:
    old = sweep_store(tmp_path / "offline")
    out = subprocess.run([sys.executable, "-m", "experiments.tracking.import_runs", str(tmp_path / "offline"),
                          "--tracking-uri", server.uri], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("imported")
    new = {r.data.tags["specws.imported_from"]: r for r in client.search_runs([exp.experiment_id])}
    parent, base, opt = (new[old[k]] for k in ("parent", "baseline", "A"))
    assert base.data.tags["mlflow.parentRunId"] == opt.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert opt.data.tags["specws.baseline_run_id"] == base.info.run_id
    assert opt.data.metrics["output_tok_s"] == 15.0
    assert all(r.info.artifact_uri.startswith("mlflow-artifacts:/") for r in (base, opt))
    records = client.download_artifacts(opt.info.run_id, "records", str(tmp_path / "back"))
    assert pd.read_json(next(Path(records).glob("*.jsonl")), lines=True)["prompt_id"].tolist() == ["p1"]


def test_a_tracking_server_whose_database_is_down_is_refused_before_anything_starts() -> None:
    """The MLflow server still answers (its /health too) but cannot read its PostgreSQL store: refused in seconds by
    an MLflow request of preflight, not found out once the measurement is being written."""
    with running_tracking_server() as own:
        cfg = server_cfg(own.uri, "database-down")
        check_tracking(typed_run(cfg).tracking)
        own.postgres.stop()
        started = time.monotonic()
        with pytest.raises(Refused, match=r"the tracking server answers but cannot read its store \(HTTP 5\d\d"):
            check_tracking(typed_run(cfg).tracking)
        assert time.monotonic() - started < 10
