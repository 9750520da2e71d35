"""experiments/analysis/diff_facts.py: the sections `read_run` makes of one stored run in a real SQLite MLflow
store -- params and tags sorted by prefix, the engine's arguments from the committed vLLM-CPU lease's server log
(docs/journal/2026-12-03-cpu), host.json (this host's real fingerprint) and host_calibration.json -- and every
section a run did not record named in `missing` with why."""
from __future__ import annotations

import json
import tarfile

import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.diff_facts import RunFacts, read_run
from experiments.config.paths import ROOT
from experiments.harness.fingerprint import collect_host

CPU_LEASE, CPU_A = ROOT / "docs" / "journal" / "2026-12-03-cpu" / "runs.tar.xz", "778689d3a7644e2da7c8759a4a06d8a3"


def _calibration() -> dict:
    samples = [{"level": 1, "when": w, "terms": {"py_loop_us": v}} for w, v in (("before", 40.0), ("after", 50.0))]
    return {"status": "on", "samples": samples, "levels": {"1": {"states": ["quiet", "busy"]}}, "changed": {"1": "x"}}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[MlflowClient, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("diff_facts")
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("diff_facts", artifact_location=str(tmp / "artifacts"))
    runs = {}
    for name in ("bare", "logged", "host"):
        run_id = client.create_run(exp, run_name=name).info.run_id
        client.log_param(run_id, "spec.method", "ngram")
        client.log_param(run_id, "workload.num_prompts", "64")
        client.log_param(run_id, "seed", "0")
        client.set_tag(run_id, "versions.vllm", "0.32.0")
        client.set_tag(run_id, "host.cpu_model", "Some CPU")
        runs[name] = run_id
    with tarfile.open(CPU_LEASE) as tar:
        members = [m for m in tar.getmembers() if f"/{CPU_A}/artifacts/server/" in m.name and m.name.endswith(".log")]
        tar.extractall(tmp / "lease", members=members, filter="data")
    (log,) = (tmp / "lease").rglob("*.log")
    client.log_artifact(runs["logged"], str(log), "server")
    host = collect_host("vllm").to_dict()
    client.log_dict(runs["host"], host, "host.json")
    client.log_dict(runs["host"], _calibration(), "host_calibration.json")
    runs["log_name"] = log.name
    runs["cpu_model"] = host["cpu"]["model"]
    return client, runs


def test_put_writes_lists_and_dicts_as_json_and_the_rest_as_text() -> None:
    facts = RunFacts("id", "label")
    facts.put("engine", {"a": [1, 2], "b": {"c": 1}, "d": 3, "e": None})
    assert facts.sections == {"engine": {"a": "[1, 2]", "b": '{"c": 1}', "d": "3", "e": "None"}}


def test_params_and_tags_go_to_the_sections_of_their_prefixes(store) -> None:
    client, runs = store
    facts = read_run(client, runs["bare"])
    assert facts.sections["config"]["spec.method"] == "ngram"
    assert facts.sections["workload"]["workload.num_prompts"] == "64"
    assert facts.sections["run"]["seed"] == "0"
    assert facts.sections["packages"]["versions.vllm"] == "0.32.0"
    assert facts.sections["host"]["host.cpu_model"] == "Some CPU"
    assert facts.label.startswith("bare (") and facts.label.endswith(f" UTC, {runs['bare'][:8]})")


def test_a_run_with_nothing_recorded_names_every_missing_section(store) -> None:
    client, runs = store
    facts = read_run(client, runs["bare"])
    assert set(facts.missing) == {"engine", "graphs", "host.json", "head", "calibration"}
    assert facts.missing["engine"] == "no host.json and no server log with the engine's arguments"
    assert "engine" not in facts.sections


def test_the_engine_arguments_come_from_the_server_log(store) -> None:
    client, runs = store
    facts = read_run(client, runs["logged"])
    engine = facts.sections["engine"]
    assert engine["(source)"] == f"server log {runs['log_name']}"
    assert engine["config.dtype"] == "bfloat16" and engine["config.max_model_len"] == "2048"
    assert facts.sections["graphs"] == {"cudagraph.bs": "[]"}
    assert "engine" not in facts.missing and "graphs" not in facts.missing


def test_host_json_and_calibration_fill_their_sections(store) -> None:
    client, runs = store
    facts = read_run(client, runs["host"])
    host = facts.sections["host"]
    assert host["cpu.model"] == runs["cpu_model"]
    assert "cpu.hostname" not in host and "cpu.platform" not in host        # HOST_SKIPPED
    assert "host.cpu_model" not in host                                      # the tag summarises host.json
    assert facts.sections["calibration"] == {"c1.py_loop_us": "45", "c1.states": "quiet,busy", "status": "on",
                                             "changed": json.dumps(["1"])}
    assert facts.missing["head"] == "the run served no head"
    assert "host.json" not in facts.missing and "calibration" not in facts.missing
