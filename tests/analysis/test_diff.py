"""experiments.analysis.diff on the committed leases: the h200c B run (2026-11-30, 1.13x) against the 2026-12-01 B
run (0.55x), both imported by the workspace's importer into one temporary SQLite store; and on two runs exported
with a host fingerprint and a calibration."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.diff import MATTERS, NO_EFFECT, UNKNOWN, classify, diff_runs, render
from experiments.config.paths import ROOT
from experiments.harness.fingerprint import collect_host
from experiments.tracking.export import Measurement, export
from experiments.tracking.uploads import Uploads

HEAD = ROOT / "experiments" / "eagle3" / "artifacts" / "smollm2_135m"

JOURNAL = ROOT / "docs" / "journal"
H200C_B, H200_1201_B = "27e9186ba69b4abea1edc0ffcdae68d6", "3b6c2dd915e74a3386bcfc3179095010"   # offline ids


@pytest.fixture(scope="module")
def both_leases(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("diff_leases")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    for lease in ("2026-11-30-h200c", "2026-12-01-h200"):
        out = subprocess.run([sys.executable, "-m", "experiments.tracking.import_runs",
                              str(JOURNAL / lease / "runs.tar.xz"), "--tracking-uri", uri,
                              "--artifact-root", str(tmp / "artifacts")], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
    return uri


def test_the_two_b_runs_differ_in_the_engine_limit_its_graphs_and_the_draft_path(both_leases: str) -> None:
    diffs, a, b = diff_runs(MlflowClient(both_leases), H200C_B, H200_1201_B[:8])   # an imported id, or its prefix
    by_key = {(d.section, d.key): d for d in diffs}
    limit = by_key["engine", "max_running_requests"]
    assert (limit.a, limit.b, limit.verdict) == ("48", "8", MATTERS)
    draft = by_key["engine", "speculative_draft_model_path"]
    assert draft.a.endswith("smollm2_135m-gpu-sglang") and draft.b.endswith("smollm2_135m-sglang")
    assert draft.verdict == UNKNOWN and "no head sha256" in draft.why   # the heads' digests were not recorded
    assert by_key["graphs", "target verify.bs"].verdict == MATTERS
    assert (by_key["workload", "workload.repetitions"].a, by_key["workload", "workload.repetitions"].b) == ("3", "1")
    # what the issue found: the logged ServerArgs differ in these four only
    engine = sorted(d.key for d in diffs if d.section == "engine" and d.a is not None and d.b is not None)
    assert engine == ["(source)", "max_running_requests", "port", "random_seed", "speculative_draft_model_path"]
    assert {by_key["engine", k].verdict for k in ("port", "random_seed")} == {NO_EFFECT}
    assert "host.json" in a.missing and "calibration" in b.missing
    text = render(diffs, a, b)
    assert "max_running_requests" in text and "A 48  |  B 8" in text
    assert "not recorded in A and B: calibration" in text and "not recorded in A and B: head" in text


def test_the_command_line_prints_the_same(both_leases: str) -> None:
    out = subprocess.run([sys.executable, "-m", "experiments.analysis.diff", H200C_B, H200_1201_B,
                          "--tracking-uri", both_leases], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "matters (" in out.stdout and "max_running_requests" in out.stdout and "1..32 (20)  |  B 1..8 (8)" \
        in out.stdout
    missing = subprocess.run([sys.executable, "-m", "experiments.analysis.diff", "0" * 32, H200C_B,
                              "--tracking-uri", both_leases], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no run with that id" in missing.stderr


@pytest.mark.parametrize("name, verdict", [
    ("engine:max_running_requests", MATTERS), ("engine:cuda_graph_max_bs", MATTERS),
    ("engine:disable_overlap_schedule", MATTERS), ("engine:attention_backend", MATTERS),
    ("engine:speculative_num_steps", MATTERS), ("packages:versions.sglang", MATTERS), ("head:sha256", MATTERS),
    ("host:cpu.model", MATTERS), ("host:cpu.mhz", MATTERS), ("calibration:c1.py_loop_us", MATTERS),
    ("engine:port", NO_EFFECT), ("engine:random_seed", NO_EFFECT), ("run:mlflow.parentRunId", NO_EFFECT),
    ("config:spec.draft_model", NO_EFFECT), ("engine:some_new_flag", UNKNOWN),
])
def test_the_table_of_what_matters(name: str, verdict: str) -> None:
    assert classify(*name.split(":", 1))[0] == verdict


def test_host_and_calibration_sections_of_exported_runs(tmp_path: Path) -> None:
    """Two runs exported with host.json and host_calibration.json: the CPU model and a probe term beyond the
    tolerance are named; a clock within 1 % and a term within 10 % are not; the same head sha256 makes the draft
    path's difference one of no effect."""
    client, run_a, run_b = exported_pair(tmp_path)
    diffs, a, b = diff_runs(client, run_a, run_b)
    by_key = {(d.section, d.key): d for d in diffs}
    assert by_key["host", "cpu.model"].verdict == MATTERS and ("host", "host.cpu_model") not in by_key   # once
    assert ("host", "cpu.mhz") not in by_key                     # 2600 vs 2610: within 1 %
    assert by_key["calibration", "c1.py_loop_us"].verdict == MATTERS   # 40 vs 65 µs
    assert ("calibration", "c1.launch_us") not in by_key          # 7.4 vs 7.6 µs: within 10 %
    assert by_key["config", "spec.draft_model"].verdict == NO_EFFECT
    assert ("head", "sha256") not in by_key and not a.missing.keys() & {"host.json", "calibration", "head"}


def _calibration(loop_us: float, launch_us: float) -> dict:
    terms = {"py_loop_us": loop_us, "launch_us": launch_us}
    samples = [{"level": 1, "block": 0, "when": w, "unix": 0.0, "terms": terms, "spread": {}, "state": "one"}
               for w in ("before", "after")]
    return {"status": "on", "samples": samples, "levels": {"1": {"states": ["one"]}}, "changed": {}}


def exported_pair(tmp: Path) -> tuple[MlflowClient, str, str]:
    """Two runs of one store, each exported with this host's fingerprint (the committed head digested), the second
    with another CPU model, a clock 0.4 % higher, a slower Python loop and another path to the same head."""
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("diff", artifact_location=str(tmp / "artifacts"))
    host = collect_host("vllm", head=HEAD).to_dict()
    other = copy.deepcopy(host)
    other["cpu"] |= {"model": "Another CPU", "mhz": (host["cpu"]["mhz"] or 2600.0) * 1.004}
    runs = []
    for facts, calibration, path in ((host, _calibration(40.0, 7.4), "/a/head"), (other, _calibration(65.0, 7.6),
                                                                                  "/b/head")):
        run_id = client.create_run(exp).info.run_id
        client.log_param(run_id, "spec.draft_model", path)
        client.log_param(run_id, "spec.method", "eagle3")
        m = Measurement(tmp / "none.jsonl", host=facts, host_calibration=calibration)
        uploads = Uploads(client, run_id)
        export(client, run_id, m, uploads)
        uploads.raise_first()
        runs.append(run_id)
    return client, runs[0], runs[1]
