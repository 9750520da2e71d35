"""Decision report: paired intervals from records the real client wrote, the report over the real H200 runs of
2026-11-30 (contaminated A, clean B), escaping (the report over runs measured on the embedded engine:
tests/e2e/test_offline_pair.py)."""
from __future__ import annotations

import json
from pathlib import Path

import mlflow
from conftest import run_fixed
from mlflow.tracking import MlflowClient

from experiments.analysis.categories import acceptor, category_rows
from experiments.analysis.report import CONTAMINATED, OptionSeries, Point, main, t_interval
from experiments.analysis.report_html import page
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.tracking.records import load_records
from tests.helpers.loopback_server import start_loopback

H200 = "smollm2_135m@h200"


def client_records(tmp: Path, tokens_per_event: int, name: str) -> list[dict]:
    """Records written by experiments/harness/client.py against a loopback server: 12 prompts in 2 disjoint slices."""
    server = start_loopback(ttft_ms=10.0, itl_ms=4.0, tokens_per_event=tokens_per_event)
    try:
        path = tmp / f"{name}.jsonl"
        run_fixed(server, VLLMAdapter(), 48, path, {f"p{i}": [100 + i, 1, 2] for i in range(12)}, [2],
                  repetitions=2, reuse=False)
        return load_records(path)
    finally:
        server.stop()


def test_paired_interval_from_client_records(tmp_path: Path) -> None:
    base = client_records(tmp_path, 1, "base")
    fast = client_records(tmp_path, 2, "fast")       # two tokens per event: twice the token rate
    assert len(base) == 12 and len({r["prompt_id"] for r in base}) == 12    # every prompt sent once
    (row,) = category_rows(fast, base, acceptor("vllm"))
    assert row["category"] == "all" and row["concurrency"] == 2 and row["n_prompts"] == 12
    assert 1.4 < row["speedup_low"] < row["speedup"] < row["speedup_high"] < 2.2 and row["verdict"] == "pays"
    # vLLM per request: every streamed chunk is a step; chunks of 2 tokens (the first one 1 or 2)
    assert 1.9 < row["accept_length"] <= 2.0 and row["prompts_to_decide"] is None
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


def test_report_on_the_old_h200_runs_flags_option_a(old_store: str, tmp_path: Path) -> None:
    """H200 runs that re-sent every prompt: every A configuration is contaminated (no verdict), B's are judged."""
    assert main([H200, "--tracking-uri", old_store, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report-smollm2_135m_h200.html").read_text()
    assert CONTAMINATED in text and "Per category" in text and "data:image/png;base64," in text
    client = MlflowClient(old_store)
    exp = client.get_experiment_by_name(H200)
    (report_run,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    verdicts = json.loads(Path(client.download_artifacts(report_run.info.run_id, "report/verdicts.json",
                                                         str(tmp_path))).read_text())
    a = {k: v for k, v in verdicts.items() if k.startswith("A ")}
    b = {k: v for k, v in verdicts.items() if k.startswith("B ")}
    assert len(a) == 6 and len(b) == 8
    assert all(v["contaminated"] and v["verdict"].startswith(CONTAMINATED) for v in a.values())
    assert not any(v["contaminated"] for v in b.values())
    assert all(v["verdict"].split(":")[0] in {"pays", "does not pay", "depends"} for v in b.values())
    for v in verdicts.values():
        for point in v["points"].values():
            assert point["low"] <= point["speedup"] <= point["high"] and point["prompts"] in (8, 10, 16)
        assert {r["category"] for r in v["categories"]} == {"all"}


def test_labels_are_escaped() -> None:
    s = OptionSeries("<script>x</script>", "a&b", {1: Point(1, 1.1, 0.9, 1.3, "<ci>", None, 1, 1.1, 5, 30)},
                     [{"category": "<cat>", "concurrency": 1, "n_prompts": 5, "speedup": 1.1, "speedup_low": 0.9,
                       "speedup_high": 1.3, "verdict": "inconclusive", "prompts_to_decide": 30,
                       "accept_length": 2.0, "accept_per_position": [0.5]}],
                     {"run <1>": "contaminated: <later> visits"})
    text = page([s], b"png", "title <t>")
    assert "<script>" not in text and "&lt;script&gt;" in text and "<cat>" not in text and "&lt;cat&gt;" in text
    assert "<later>" not in text and "a&amp;b" in text and "title &lt;t&gt;" in text
    assert s.verdict().startswith(CONTAMINATED)
