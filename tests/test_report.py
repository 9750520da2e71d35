"""Decision report: intervals from records the real client wrote, and the report over runs the workspace
measured with the embedded engine in a temporary store."""
from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from bench.harness_fidelity import LoopbackProcess
from experiments.client import WorkloadRunner, load_records
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.prompts import Prompt
from experiments.report import main, per_repetition_tok_s, single_run_interval, t_interval
from tests.conftest import run_workspace

EXPERIMENT = "smollm2_135m@local"


def client_records(tmp: Path, tokens_per_event: int, repetitions: int, name: str) -> list[dict]:
    """Records written by experiments/client.py against a loopback server on a known schedule."""
    server = LoopbackProcess(ttft_ms=10.0, itl_ms=4.0, tokens_per_event=tokens_per_event)
    try:
        path = tmp / f"{name}.jsonl"
        runner = WorkloadRunner(server, VLLMAdapter(), "loopback", 48, 0.0, 60, path)
        runner.run([Prompt(f"p{i}", [100 + i, 1, 2]) for i in range(4)], [2], repetitions, 0)
        return load_records(path)
    finally:
        server.stop()


def test_intervals_from_client_records(tmp_path: Path) -> None:
    base = client_records(tmp_path, 1, 3, "base")
    fast = client_records(tmp_path, 2, 3, "fast")       # two tokens per event: twice the token rate
    reps = per_repetition_tok_s(base)
    assert len(reps) == 3
    # 2 streams of one token per 4 ms: at most 500 tok/s, less the 10 ms first-token wait per request
    assert all(250 < r < 520 for r in reps), reps
    speedup = np.mean(per_repetition_tok_s(fast)) / np.mean(reps)
    lo, hi, how = single_run_interval(fast, base, speedup, np.random.default_rng(0))
    assert how == "t over 3 repetitions" and lo < speedup < hi
    assert 1.4 < speedup < 2.2
    lo1, hi1, how1 = single_run_interval(fast[:4], base[:4], speedup, np.random.default_rng(0))
    assert how1.startswith("bootstrap") and lo1 <= speedup <= hi1
    assert t_interval([1.0, 1.0, 1.0]) == (1.0, 1.0)


def test_bad_targets_are_refused_and_nothing_is_written(tmp_path: Path, store: str, capsys) -> None:
    assert main(["no-such-experiment-or-run", "--tracking-uri", store, "--out", str(tmp_path)]) == 2
    assert "neither an experiment nor a run" in capsys.readouterr().err
    mlflow.set_tracking_uri(store)
    client = MlflowClient()
    exp = client.create_experiment("only-baselines")
    client.create_run(exp, tags={"specws.mode": "measure", "specws.option": "baseline"})
    assert main(["only-baselines", "--tracking-uri", store, "--out", str(tmp_path)]) == 2
    assert "no finished speculative run" in capsys.readouterr().err
    assert len(client.search_runs([exp])) == 1 and not list(tmp_path.glob("report-*"))


@pytest.mark.slow
def test_report_on_measured_runs(tmp_path: Path, embedded_ready) -> None:
    """Baseline + option A measured by `experiments.run` on the smoke workload, then the report."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_workspace("+option=A", "workload=smoke", "workload.concurrency=[1,2]", f"tracking.uri={store}",
                        f"tracking.artifact_root={tmp_path / 'artifacts'}",
                        'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]')
    assert out.returncode == 0, out.stderr[-4000:]
    mlflow.set_tracking_uri(store)
    client = MlflowClient()
    exp = client.get_experiment_by_name(EXPERIMENT)
    (option,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("specws.option") == "A"]
    m = option.data.metrics
    # the speedup model ran inside the measurement and logged its predictions beside the measurements
    assert {"predicted_speedup_c1", "predicted_output_tok_s_c2", "predicted_break_even_accept_length_c1"} <= set(m)
    assert "replay" in option.data.tags["specws.prediction"]
    assert main([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "reports")]) == 0
    html = tmp_path / "reports" / "report-smollm2_135m_local.html"
    assert html.exists() and (tmp_path / "reports" / "report-smollm2_135m_local.png").exists()
    text = html.read_text()
    assert "Verdict" in text and "data:image/png;base64," in text
    (report_run,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    verdicts = json.loads(Path(client.download_artifacts(report_run.info.run_id, "report/verdicts.json",
                                                         str(tmp_path))).read_text())
    (entry,) = verdicts.values()
    assert set(entry["points"]) == {"1", "2"}
    measured = m["output_tok_s_c1"] / client.get_run(option.data.tags["specws.baseline_run_id"]).data.metrics[
        "output_tok_s_c1"]
    point = entry["points"]["1"]
    assert point["speedup"] == pytest.approx(measured) and point["low"] <= measured <= point["high"]
    assert point["predicted"] == pytest.approx(m["predicted_speedup_c1"])
    assert entry["verdict"].split(":")[0] in {"pays", "does not pay", "depends"}
    # --since: one session's runs; a time after every run leaves nothing, refused without writing a report
    start = datetime.fromtimestamp(option.info.start_time / 1000, UTC).strftime("%Y-%m-%dT%H:%M")
    assert main([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "since"), "--since", start]) == 0
    assert len(list((tmp_path / "since").glob("report-*-since-*.png"))) == 1
    assert main([EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "later"), "--since", "2100-01-01"]) == 2
    assert not (tmp_path / "later").exists()
