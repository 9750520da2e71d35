"""The verdict block from a real run store: records the workspace's client wrote against the loopback server (the
option streaming two tokens per event, about twice the baseline's rate), logged into a temporary SQLite store, then
the post-run analysis and the verdict block as the runner calls them; the description, the decision_* metrics, the
console, a baseline's block and a sweep parent's."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_fixed
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from experiments.analysis.post_run import log_run_analysis
from experiments.analysis.verdict_block import DEFAULT_URI, NOTE_TAG, log_verdict_block, next_commands
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.summary import summarize
from tests.helpers.loopback_server import start_loopback

EXPERIMENT = "verdict@loopback"
GREEDY = {"greedy_compared": 12.0, "greedy_exact_match": 0.75, "greedy_near_ties": 3.0,
          "greedy_real_divergences": 0.0}
FORECAST = {"forecast_speedup_c1": 1.9, "forecast_speedup_low_c1": 1.6, "forecast_speedup_high_c1": 2.3,
            "forecast_covered_c1": 1.0}   # as forecast_check logs them (a forecast made before the run)


def loopback_records(tmp: Path, tokens_per_event: int, name: str) -> tuple[Path, dict[str, float]]:
    """12 prompts, 6 per level at c = 1 and 4, each sent once; the client's records and summary metrics."""
    server = start_loopback(ttft_ms=10.0, itl_ms=4.0, tokens_per_event=tokens_per_event)
    try:
        path = tmp / f"{name}.jsonl"
        levels = run_fixed(server, VLLMAdapter(), 48, path, {f"p{i}": [100 + i, 1, 2] for i in range(12)}, [1, 4],
                           reuse=False)
        return path, summarize(levels, VLLMAdapter()).metrics
    finally:
        server.stop()


def log_run(client: MlflowClient, exp: str, name: str, records: Path, metrics: dict[str, float],
            params: dict[str, str], tags: dict[str, str]) -> str:
    run_id = client.create_run(exp, run_name=name, tags={"specws.mode": "measure", "specws.workload": "quick",
                                                         **tags}).info.run_id
    for k, v in {"engine.name": "vllm", "workload.concurrency": "[1, 4]", **params}.items():
        client.log_param(run_id, k, v)
    client.log_batch(run_id, metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()])
    client.log_artifact(run_id, str(records), "records")
    return run_id


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[MlflowClient, str, Path, tuple, tuple]:
    tmp = tmp_path_factory.mktemp("verdict")
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment(EXPERIMENT, artifact_location=str(tmp / "artifacts"))
    base = loopback_records(tmp, 1, "base")
    fast = loopback_records(tmp, 2, "fast")
    return client, exp, tmp, base, fast


def measured_option(client: MlflowClient, exp: str, base: tuple, fast: tuple, k: int = 4,
                    tags: dict | None = None) -> tuple[str, str]:
    """A baseline and an option run against it, analysed as the runner does (log_run_analysis, then the block)."""
    base_id = log_run(client, exp, "baseline-quick", base[0], base[1], {"spec.method": "none"},
                      {"specws.option": "baseline", "specws.spec_method": "none", **(tags or {})})
    option_id = log_run(client, exp, f"A-quick-k{k}", fast[0], fast[1] | GREEDY | FORECAST,
                        {"spec.method": "ngram", "spec.num_draft_tokens": str(k)},
                        {"specws.option": "A", "specws.spec_method": "ngram", "specws.baseline_run_id": base_id,
                         **(tags or {})})
    baseline = client.get_run(base_id)
    for run_id, paired in ((base_id, None), (option_id, baseline)):
        log_run_analysis(client, run_id, paired, "vllm")
        log_verdict_block(client, run_id, paired, "vllm")
    return base_id, option_id


def test_the_description_says_the_verdict_per_level_losslessness_sample_and_next_commands(runs, capsys) -> None:
    client, exp, _, base, fast = runs
    _, option_id = measured_option(client, exp, base, fast)
    run = client.get_run(option_id)
    note, m = run.data.tags[NOTE_TAG], run.data.metrics
    head, *lines = note.splitlines()
    assert head == "Verdict: A (n-gram, 4 draft tokens) on quick — pays at c=1 and 4"
    for c in (1, 4):   # each level: its speedup, 95 % interval and verdict, as the analysis logged them
        low, est, high = (m[f"cat/all/speedup_c{c}{s}"] for s in ("_low", "", "_high"))
        assert 1.3 < low < est < high < 2.5 and run.data.tags[f"specws.verdict_c{c}"] == "pays"
        assert (f"- c={c}: speedup {est:.2f}x, 95 % interval [{low:.2f}, {high:.2f}]: **pays** (6 prompts)"
                in lines)
        assert (m[f"decision_speedup_c{c}"], m[f"decision_speedup_low_c{c}"], m[f"decision_speedup_high_c{c}"],
                m[f"decision_verdict_c{c}"]) == (est, low, high, 1.0)
    assert ("- lossless: 0 real divergences; 3 of 12 outputs differ from the baseline's only at near ties "
            "(top-2 log-probabilities within bf16 rounding)") in lines
    assert "- **sample**: too few prompts to decide on (6 per level, fewer than 32); run workload=grounded" in lines
    assert "- forecast made before the run: c=1 1.90x [1.60, 2.30] pays, the measurement inside its interval" in lines
    uri = client.tracking_uri
    commands = [line for line in lines if line.startswith("- `") or "MLflow UI" in line]
    assert commands == [
        f"- `.venv/bin/python -m experiments.analysis.report {EXPERIMENT} --tracking-uri {uri}` — the decision "
        "report (HTML)",
        f"- `.venv/bin/mlflow ui --workers 1 --backend-store-uri {uri}` — the MLflow UI (this run: {option_id})",
        f"- `.venv/bin/python -m experiments.analysis.recommend --experiment {EXPERIMENT} --tracking-uri {uri}` — "
        "one answer per load"]
    # on the console: the block is the last thing printed, each line whole, without markdown's marks
    err = capsys.readouterr().err.rstrip().splitlines()
    assert head in err and err[-1].strip() == commands[-1].replace("`", "")
    assert not any("**" in line or "`" in line for line in err[err.index(head):])


def test_a_baseline_says_it_is_the_reference_and_the_default_store_names_bin_ui(runs, capsys) -> None:
    client, exp, _, base, fast = runs
    base_id, _ = measured_option(client, exp, base, fast)
    note = client.get_run(base_id).data.tags[NOTE_TAG]
    assert re.match(r"Verdict: baseline \(no speculation\) on quick — the reference options are paired with: "
                    r"[\d.]+ tok/s at c=1, [\d.]+ tok/s at c=4\n", note)
    assert not any(k.startswith("decision_") for k in client.get_run(base_id).data.metrics)

    class DefaultStore:
        tracking_uri = DEFAULT_URI

    ui = next_commands(DefaultStore(), "smollm2_135m@local", "r1")
    assert ui[0] == ("- `.venv/bin/python -m experiments.analysis.report smollm2_135m@local` — the decision report "
                     "(HTML)")
    assert ui[1] == "- `bin/ui` — the MLflow UI (this run: r1)"
    assert ui[2].startswith("- `.venv/bin/python -m experiments.analysis.recommend --experiment smollm2_135m@local`")


def test_a_sweep_parent_gets_the_verdict_of_its_children(runs) -> None:
    client, exp, _, base, fast = runs
    parent = client.create_run(exp, run_name="sweep-A", tags={
        "specws.sweep": "parent", "specws.option": "A",
        "specws.sweep_overrides": "+option=A workload=quick spec.num_draft_tokens=2,4"}).info.run_id
    children = [measured_option(client, exp, base, fast, k, {"mlflow.parentRunId": parent})[1] for k in (2, 4)]
    head, *lines = client.get_run(parent).data.tags[NOTE_TAG].splitlines()
    assert re.match(r"Verdict: sweep of A over spec\.num_draft_tokens on quick — best at c=1: "
                    r"spec\.num_draft_tokens=[24] [\d.]+x \[[\d.]+, [\d.]+\] pays; best at c=4: ", head)
    assert "2 measured children:" in lines
    for k, child in zip((2, 4), children, strict=True):
        assert any(line.startswith(f"- spec.num_draft_tokens={k}: c=1 ") and line.endswith(f"({child})")
                   for line in lines)
    assert any(f"experiments.analysis.report {parent} --tracking-uri" in line for line in lines)
