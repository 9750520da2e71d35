"""The post-run prediction (experiments/analysis/predict.py) over runs in an offline store: what it logs from
what a measurement stored, the reasons it gives when it cannot predict, and that it never raises; the stored
config read through the one typed reader and the engines' rules."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.analysis.predict import log_prediction
from experiments.analysis.runs import RunConfig
from experiments.analysis.speedup.model import level_acceptance
from experiments.tracking.offline_store import OfflineClient, RunData, RunInfo
from experiments.tracking.store import Metric, Param

NGRAM = {"engine.name": "vllm", "spec.method": "ngram", "spec.num_draft_tokens": "4", "spec.ngram.min_match": "2",
         "spec.ngram.max_match": "4", "model.max_model_len": "2048"}
BASE = {"output_tok_s_c1": 29.0, "tpot_mean_ms_c1": 34.0, "e2e_mean_ms_c1": 4000.0, "ttft_mean_ms_c1": 80.0}
# 1010 tokens of 10 requests: 200 drafted steps (counted by the engine), accept length 3.5, 510 chunks
OPTION = {"output_tok_s_c1": 50.0, "output_tokens_c1": 1010.0, "requests_c1": 10.0, "accept_length_c1": 3.5,
          "tokens_per_chunk_c1": 1010 / 510, "steps_with_draft_c1": 1.0, "spec_drafts_c1": 200.0}


def logged_run(client: OfflineClient, params: dict, metrics: dict, records: list[dict] | None = None,
               tmp: Path | None = None) -> str:
    run_id = client.create_run("exp", tags={"specws.mode": "measure"}).info.run_id
    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()],
                     metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()])
    if records is not None:
        path = tmp / f"records-{run_id}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        client.log_artifact(run_id, str(path), "records")
    return run_id


def baseline_run(metrics: dict):
    return type("Run", (), {"info": RunInfo("base", "exp", "FINISHED", 0), "data": RunData(metrics, {}, {})})()


def repeating_records(n: int = 4) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        prompt = rng.integers(0, 500, 120).tolist()
        out.append({"concurrency": 1, "repetition": 0, "prompt_id": f"p{i}", "prompt_token_ids": prompt,
                    "output_token_ids": prompt[10:60], "chunk_tokens": [], "error": None})
    return out


def test_prediction_from_the_replayed_records(tmp_path: Path) -> None:
    client = OfflineClient(tmp_path / "store")
    records = repeating_records()
    run_id = logged_run(client, NGRAM, OPTION, records, tmp_path)
    predicted = log_prediction(client, run_id, baseline_run(BASE), records)
    run = client.get_run(run_id)
    assert "replay of the records" in run.data.tags["specws.prediction"]
    assert "no probe, b_tok = b_seq" in run.data.tags["specws.prediction"]
    assert predicted and {k: run.data.metrics[k] for k in predicted} == predicted
    assert predicted["predicted_tokens_per_step_c1"] > 3.0     # the copied outputs replay with long drafts


def test_counters_use_the_drafts_the_measurement_logged(tmp_path: Path) -> None:
    client = OfflineClient(tmp_path / "store")
    run_id = logged_run(client, NGRAM, OPTION, [], tmp_path)
    predicted = log_prediction(client, run_id, baseline_run(BASE), [])
    assert "engine counters (no replay: " in client.get_run(run_id).data.tags["specws.prediction"]
    tau, _ = level_acceptance(OPTION, 1, OPTION["spec_drafts_c1"])
    assert tau == pytest.approx(2.0) and predicted["predicted_tokens_per_step_c1"] == pytest.approx(tau)


def test_reasons_instead_of_a_prediction_and_never_a_raise(tmp_path: Path) -> None:
    client = OfflineClient(tmp_path / "store")
    run_id = logged_run(client, NGRAM, OPTION)
    assert log_prediction(client, run_id, None, []) == {}
    assert client.get_run(run_id).data.tags["specws.prediction"] == "not predicted: no paired baseline"
    assert log_prediction(client, run_id, baseline_run({"output_tok_s_c4": 1.0}), []) == {}
    assert client.get_run(run_id).data.tags["specws.prediction"].startswith("not predicted: PredictionUnavailable")
    base_id = logged_run(client, {"engine.name": "vllm", "spec.method": "none"}, BASE)
    assert log_prediction(client, base_id, None, []) == {}
    assert "specws.prediction" not in client.get_run(base_id).data.tags


def test_stored_config_and_the_engines_rules() -> None:
    vllm = RunConfig.from_params(NGRAM | {"workload.concurrency": "[1, 4, 8]", "limits.max_running_requests": "8"})
    assert vllm.concurrency == (1, 4, 8) and vllm.max_running_requests == 8 and vllm.max_model_len == 2048
    window = vllm.ngram_window()
    assert (window.min_match, window.max_match, window.k, window.exact) == (2, 4, 4, True)
    assert not vllm.fixed_verify_width and vllm.verified_per_step is None and vllm.graph_batch_limit is None
    with pytest.raises(ValueError, match="spec.ngram.min_match not set"):
        RunConfig.from_params(NGRAM | {"spec.ngram.min_match": "None"}).ngram_window()
    sglang = RunConfig.from_params({"engine.name": "sglang", "spec.method": "ngram", "spec.num_draft_tokens": "8",
                                    "site.engine_args.sglang": "['--cuda-graph-max-bs', '8', '--x']",
                                    "engine.extra_args": "['--cuda-graph-max-bs-decode', '4']"})
    assert sglang.fixed_verify_width and sglang.verified_per_step == 8.0 and sglang.graph_batch_limit == 4
    window = sglang.ngram_window()
    assert (window.min_match, window.max_match, window.k, window.exact) == (1, 18, 7, False)
    unknown = RunConfig.from_params({"spec.method": "ngram", "spec.num_draft_tokens": "4"})
    assert unknown.engine == "?" and unknown.ngram_window() is None and not unknown.fixed_verify_width
