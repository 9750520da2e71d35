"""The runner against the team's tracking server (`bin/tracking-server`: PostgreSQL + mlflow server, proxied
artifacts) on the embedded engine: two runners at once -- option A pairing with the baseline it measures, and a
two-child baseline sweep -- whose pairing, parent/child links, artifacts and datasets all arrive, and which the
export reads back through the server; then the MLflow server killed while a run measures: the run's writes are kept
on disk and recorded by the next runner, nothing of the measurement lost."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.export import export
from experiments.config.paths import ROOT
from experiments.tracking import spool
from experiments.tracking.records import load_records
from tests.helpers.tracking_server import FAST_GIVE_UP, TeamServer, wait_for_run

EXPERIMENT = "smollm2_135m@local"
pytestmark = pytest.mark.slow
TINY = ["workload=smoke", "workload.warmup_requests=0", "baseline.allow_loaded_host=true",
        'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]']   # eager: starts in ~35 s


@pytest.fixture(scope="module")
def team():
    folder = Path(tempfile.mkdtemp(prefix="specws-team-"))
    folder.chmod(0o755)   # as root, PostgreSQL runs as the postgres user, which must reach its folder
    server = TeamServer(folder / "tracking")
    server.start()
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


def runner(uri: str, out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "experiments.run", *args, *TINY, "tracking=server",
                                 f"tracking.uri={uri}", f"hydra.run.dir={out}", f"hydra.sweep.dir={out}"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})


def finished(proc: subprocess.Popen, out: Path, timeout_s: float = 1500) -> str:
    rc = proc.wait(timeout=timeout_s)
    log = (out / "log").read_text()
    assert rc == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def two_runners(team, embedded_ready, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    # locks of its own: runners wait for each other's CPU engine (experiments/harness/devices.py); these two write
    # into the server at the same time
    option = runner(team.uri, tmp / "option", "+option=A", "workload.max_tokens=16",
                    env={"SPECWS_LOCK_DIR": str(tmp / "option-locks")})
    sweep = runner(team.uri, tmp / "sweep", "-m", "+option=baseline", "workload.max_tokens=16,24",
                   "workload.reuse_prompts=true")   # the two children share one server
    finished(option, tmp / "option")
    finished(sweep, tmp / "sweep")
    client = MlflowClient(team.uri)
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    return client, runs


def test_the_option_pairs_with_the_baseline_it_measured(two_runners) -> None:
    client, runs = two_runners
    (opt,) = [r for r in runs if r.data.tags.get("specws.option") == "A"]
    base = client.get_run(opt.data.tags["specws.baseline_run_id"])
    assert base.data.tags["specws.option"] == "baseline" and base.info.status == opt.info.status == "FINISHED"
    assert base.data.tags["specws.pair_key"] == opt.data.tags["specws.pair_key"]
    assert opt.data.metrics["speedup_vs_baseline"] == pytest.approx(
        opt.data.metrics["output_tok_s"] / base.data.metrics["output_tok_s"], rel=1e-9)
    assert "mlflow.parentRunId" not in opt.data.tags


def test_the_sweep_parent_and_its_children_are_linked(two_runners) -> None:
    _, runs = two_runners
    (parent,) = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and parent.data.tags["specws.children"] == "2"
    assert sorted(c.data.params["workload.max_tokens"] for c in children) == ["16", "24"]
    assert {c.data.tags["specws.option"] for c in children} == {"baseline"}


def test_the_two_runners_wrote_at_the_same_time(two_runners) -> None:
    client, runs = two_runners
    (opt,) = [r for r in runs if r.data.tags.get("specws.option") == "A"]
    first = client.get_run(opt.data.tags["specws.baseline_run_id"]).info.start_time   # the option's runner began
    (parent,) = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
    assert parent.info.start_time < opt.info.end_time and first < parent.info.end_time


def test_records_server_logs_and_datasets_arrive_through_the_server(two_runners, team, tmp_path) -> None:
    client, runs = two_runners
    measured = [r for r in runs if r.data.tags.get("specws.mode") == "measure"]
    assert len(measured) == 4    # the option, its baseline, the two children
    for run in measured:
        run_id = run.info.run_id
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
        records = Path(client.download_artifacts(run_id, f"records/records-{run_id}.jsonl", str(tmp_path)))
        assert len(load_records(records)) == run.data.metrics["requests_c1"] == 2
        assert list(team.folder.glob(f"artifacts/*/{run_id}/artifacts/records/records-{run_id}.jsonl"))
        (log,) = client.list_artifacts(run_id, "server")
        assert log.path.endswith(".log") and log.file_size > 0
        (dataset,) = client.get_run(run_id).inputs.dataset_inputs
        assert dataset.dataset.digest == run.data.tags["specws.measured_digest"][:36]


def test_the_export_reads_the_runs_and_records_back_through_the_server(two_runners, team, tmp_path) -> None:
    client, runs = two_runners
    done = export(MlflowClient(team.uri), EXPERIMENT, tmp_path)
    levels = pd.read_parquet(tmp_path / "levels.parquet")
    assert (done.runs, done.levels, done.records) == (4, 4, 8)      # four runs at c = 1, two requests each
    (row,) = levels[levels["option"] == "A"].to_dict("records")
    (opt,) = [r for r in runs if r.data.tags.get("specws.option") == "A"]
    assert row["output_tok_s"] == opt.data.metrics["output_tok_s_c1"] and row["spec.num_draft_tokens"] == 4
    assert row["speedup_vs_baseline"] == opt.data.metrics["speedup_vs_baseline_c1"]


def test_a_server_killed_mid_run_loses_nothing_and_the_next_runner_records_it(team, embedded_ready,
                                                                              tmp_path) -> None:
    proc = runner(team.uri, tmp_path / "gone", "+option=baseline", "run.name=gone", "workload.max_tokens=16",
                  env=FAST_GIVE_UP)
    try:
        run = wait_for_run(MlflowClient(team.uri), EXPERIMENT, "gone", "specws.records_path", proc)
        assert team.kill_mlflow() == 1      # the script saw its MLflow server die, stopped PostgreSQL, exited 1
        log = finished(proc, tmp_path / "gone")
    finally:
        if proc.poll() is None:
            proc.kill()
        team.start()
    run_id = run.info.run_id
    assert "is unreachable" in log and (spool.spool_root(team.uri) / run_id / "run.json").exists()
    assert MlflowClient(team.uri).get_run(run_id).info.status == "RUNNING"
    finished(runner(team.uri, tmp_path / "next", "+option=baseline", "run.dry_run=true"), tmp_path / "next")
    client = MlflowClient(team.uri)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.metrics["requests_c1"] == 2 and got.data.metrics["errors"] == 0
    kept = Path(run.data.tags["specws.records_path"])      # written as the requests finished, before any upload
    back = Path(client.download_artifacts(run_id, f"records/{kept.name}", str(tmp_path / "back")))
    assert load_records(back) == load_records(kept) and len(load_records(kept)) == 2
    assert client.list_artifacts(run_id, "server") and not (spool.spool_root(team.uri) / run_id).exists()
