"""The embedded default pairs option and baseline in time: both vLLM-CPU servers up together, each block of
first-seen prompts sent to one and then the other (ABBA), two runs that name each other, intervals over blocks."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
from conftest import run_workspace
from mlflow.tracking import MlflowClient

EXPERIMENT = "smollm2_135m@local"
EAGER = 'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]'
pytestmark = pytest.mark.slow


def _records(client: MlflowClient, run_id: str) -> list[dict]:
    path = client.download_artifacts(run_id, f"records/records-{run_id}.jsonl")
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def paired(tmp_path_factory, embedded_ready) -> tuple[MlflowClient, dict]:
    """A on the smoke prompts at c = 1 and 2, two blocks per level, paired in time (the local site's default)."""
    tmp_path = tmp_path_factory.mktemp("paired")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_workspace("+option=A", "workload=smoke", "workload.num_prompts=9", "workload.concurrency=[1,2]",
                        "workload.blocks=2", "workload.max_tokens=24", "baseline.allow_loaded_host=true", EAGER,
                        f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path / 'artifacts'}",
                        f"hydra.run.dir={tmp_path / 'run'}", timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client, {r.data.tags["specws.option"]: r for r in client.search_runs([exp.experiment_id])}


def test_option_and_baseline_alternate_blocks_on_servers_up_together(paired) -> None:
    client, runs = paired
    option, base = runs["A"], runs["baseline"]
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    assert option.data.tags["specws.timing"] == base.data.tags["specws.timing"] == "interleaved"
    assert option.data.tags["specws.baseline_run_id"] == base.info.run_id
    assert base.data.tags["specws.paired_option_run_id"] == option.info.run_id

    first_sent: dict[tuple[int, int], list[tuple[float, str]]] = defaultdict(list)
    prompts = {}
    for name, run in runs.items():
        records = _records(client, run.info.run_id)
        prompts[name] = sorted(r["prompt_id"] for r in records)
        for (c, block), sent in _by_block(records).items():
            first_sent[(c, block)].append((sent, name))
    assert prompts["A"] == prompts["baseline"] and len(set(prompts["A"])) == len(prompts["A"])  # once per server
    firsts = [min(pair)[1] for _, pair in sorted(first_sent.items())]
    assert firsts == ["A", "baseline", "A", "baseline"]        # each block pair's order alternates: ABBA
    m = option.data.metrics
    assert m["cat/all/speedup_c1_low"] <= m["cat/all/speedup_c1"] <= m["cat/all/speedup_c1_high"]
    assert "step_p50_ms_c1" in m and "step_excess_ms_c1" in m


def _by_block(records: list[dict]) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for r in records:
        key = (r["concurrency"], r["repetition"])
        out[key] = min(out.get(key, r["sent_unix"]), r["sent_unix"])
    return out


def test_every_run_records_its_host_and_its_calibration(paired) -> None:
    client, runs = paired
    for run in runs.values():
        tags, m = run.data.tags, run.data.metrics
        assert tags["host.calibration"] == "on" and tags["host.cpu_model"] and tags["host.packages_sha256"]
        assert tags["host.state_changed"] == "none" or tags["host.state_changed"].startswith("c")
        for c in (1, 2):
            assert m[f"host_py_loop_us_c{c}_before"] > 0 and m[f"host_py_loop_us_c{c}_after"] > 0
            assert m[f"host_engine_cpu_s_c{c}"] > 0 and f"host_steal_pct_c{c}" in m
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"host.json", "host_calibration.json"} <= artifacts
