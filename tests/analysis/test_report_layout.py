"""The report's figure fits its title and names each panel by its workload (the prompt set in parentheses where
that has another name), with the prompts per level, a speedup axis from zero and a legend of what is drawn; the
report speaks one vocabulary (configurations in words, workloads by name, "pays at c = 1 and 4"), warns where a level
rests on too few prompts, shows one category row where a workload has one category and one telemetry line on a host
without GPU telemetry, and carries the recommendation, the latency targets' verdicts and the throughput vs per-user
speed figure (on the recorded vLLM-CPU lease of 2026-12-03, tests/analysis/leases.py, with a 2.18 s TTFT target that
option A breaks at c = 1); it takes the experiment positionally or as --experiment, and says what it replaced."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.report import OptionSeries, Point, main
from experiments.analysis.report.figure import figure
from tests.analysis import leases
from tests.analysis.leases import CPU_EXPERIMENT, copy_store

cpu_store = leases.cpu_store
LONG = "Speculative decoding: kimi_k25_int4_w4a16_tp8@blackwell-rtx-pro-6000-sm120-pcie-b, runs since 2026-11-30T21:00Z"


def series(workload: str, prompt_set: str | None) -> OptionSeries:
    return OptionSeries("A: n-gram, 4 draft tokens", workload,
                        {c: Point(c, 1.1, 0.9, 1.3, "ci", 1.05, 1) for c in (1, 4)}, prompt_set=prompt_set)


@pytest.mark.parametrize(("workloads", "panels"), [
    ([("file", "question.jsonl")], {"file (prompt set question.jsonl)"}),
    ([("file", "question.jsonl"), ("quick", "grounded")],
     {"file (prompt set question.jsonl)", "quick (prompt set grounded)"}),
    ([("quick", "grounded"), ("grounded", "grounded"), ("chat", "chat")],
     {"quick (prompt set grounded)", "grounded", "chat"})])
def test_the_title_fits_and_panels_are_named_by_workload(workloads, panels) -> None:
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
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        # no forecast was made: neither the legend nor the key names hollow squares
        assert "post-hoc model" in labels and "forecast before the run (95 %)" not in labels
        assert ax.get_ylim()[0] == 0.0
    assert "hollow squares" not in fig._suptitle.get_text()


def test_a_panel_names_its_prompts_per_level_and_only_the_measured_kind_when_nothing_else_was_drawn() -> None:
    s = OptionSeries("B: EAGLE-3, 3 steps", "quick", {c: Point(c, 1.1, 0.9, 1.3, "ci", None, 1, prompts=12)
                                                      for c in (1, 4)}, prompt_set="grounded")
    fig = figure([s], "t")
    (ax,) = fig.axes
    assert ax.get_title() == "quick (prompt set grounded): 12 prompts per level"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["B: EAGLE-3, 3 steps", "measured (95 % CI)"]
    assert "hollow" not in fig._suptitle.get_text() and ax.get_ylim()[0] == 0.0


def test_the_report_carries_the_recommendation_slo_verdicts_and_frontier(cpu_store: str, tmp_path: Path) -> None:
    store = copy_store(cpu_store, tmp_path)
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(CPU_EXPERIMENT)
    for run in client.search_runs([exp.experiment_id], "tags.`specws.workload` = 'grounded'"):
        client.log_param(run.info.run_id, "workload.slo.ttft_p99_s", "2.18")
    assert main([CPU_EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "out")]) == 0
    html = (tmp_path / "out" / "report-smollm2_135m_local.html").read_text()
    assert "Recommendation (one answer per load)" in html
    assert "no speculation at c = 1; A: n-gram, 4 draft tokens at c = 4" in html
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
    from experiments.analysis.recommend.decision import Candidate, Load, decide
    from experiments.analysis.recommend.render import html_section, markdown
    from experiments.analysis.stats import Interval
    spec = {"method": "ngram", "num_steps": None, "topk": None, "num_draft_tokens": 4, "draft_model": None,
            "moe_expert_budget": None, "ngram": {"min_match": 2, "max_match": 4}}
    odd = Candidate("A k=4", "cfg", "<script>|x", "vllm", spec, Interval(1.3, 1.1, 1.5, 12, "paired"), {})
    rec = Recommendation("w&w", "<set>", {}, [decide(Load("closed", None, 1), [odd])],
                         {"<bad>": "contaminated — not a verdict"})
    html = html_section([rec])
    assert "<script>" not in html and "&lt;script&gt;|x" in html and "w&amp;w" in html and "&lt;bad&gt;" in html
    md = markdown([rec], "t")
    assert "## w&w (prompt set <set>)" in md
    assert "**<script>|x: n-gram, 4 draft tokens at c = 1**" in md
    assert "| c 1 | <script>\\|x: n-gram, 4 draft tokens | decided |" in md


def test_the_report_speaks_one_vocabulary_warns_and_says_what_it_replaced(cpu_store: str, tmp_path: Path,
                                                                          capsys) -> None:
    store, out = copy_store(cpu_store, tmp_path), tmp_path / "out"
    assert main(["--experiment", CPU_EXPERIMENT, "--tracking-uri", store, "--out", str(out)]) == 0
    first = capsys.readouterr().err
    assert "A: n-gram, 4 draft tokens on grounded: pays at c = 1 and 4" in first and "replaced" not in first
    assert "warning: A: n-gram, 4 draft tokens on grounded: too few prompts to decide on (12 per level" in first
    html = (out / "report-smollm2_135m_local.html").read_text()
    assert "<li><b>A: n-gram, 4 draft tokens</b> on grounded: pays at c = 1 and 4;" in html
    assert "A k=4" not in html and "ngram k=" not in html and "(workload " not in html
    assert ('<p class="warn"><b>Warning</b>: C: EAGLE-3, 3 steps on chat: too few prompts to decide on (12 per '
            "level, fewer than 32); run workload=grounded</p>") in html
    # one workload, one category: one row per level
    categories = html.split("<h2>Per category</h2>")[1].split("</table>")[0]
    assert categories.count("<tr><td>A: n-gram, 4 draft tokens</td>") == 2 and "<td>grounded</td><td>1</td><td>all" \
        in categories and "<td>1</td><td>grounded</td>" not in categories
    # no GPU in these runs: one line, no table, no figure
    assert html.count("no GPU telemetry") == 1 and "<h2>Telemetry</h2>" not in html
    assert "no GPU telemetry on this host: no telemetry recorded" in html and not list(out.glob("telemetry-*"))
    # the recommendation's columns explained; no caveat about a window nobody set
    assert '<th title="about how many more prompts per level' in html and "further prompts: about how many" in html
    assert "remove it" not in html and "remove it" not in (out / "recommendation-smollm2_135m_local.md").read_text()
    assert main([CPU_EXPERIMENT, "--tracking-uri", store, "--out", str(out)]) == 0
    assert f"replaced {out / 'report-smollm2_135m_local.html'}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main([CPU_EXPERIMENT, "--experiment", "other", "--tracking-uri", store, "--out", str(out)])
    assert refused.value.code == 2 and "two different targets given" in capsys.readouterr().err
