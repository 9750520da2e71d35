"""Decision report: paired intervals from records the real client wrote, the forecast made before a run beside
its measurement (a store of runs over those records), the report over the real H200 runs of 2026-11-30
(contaminated A, clean B), escaping (the report over runs measured on the embedded engine:
tests/e2e/test_offline_pair.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow
import pytest
from conftest import run_fixed
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from experiments.analysis.categories import acceptor, category_rows
from experiments.analysis.report import CONTAMINATED, OptionSeries, Point, build_series, main, select_runs, t_interval
from experiments.analysis.report.figure import figure
from experiments.analysis.report.page import page
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.summary import summarize
from experiments.tracking.records import load_records
from tests.helpers.loopback_server import start_loopback

H200 = "smollm2_135m@h200"


def client_run(tmp: Path, tokens_per_event: int, name: str) -> tuple[Path, dict[str, float]]:
    """Records written by experiments/harness/client.py against a loopback server (12 prompts in 2 disjoint
    slices at c = 2) and the workspace's summary metrics of them."""
    server = start_loopback(ttft_ms=10.0, itl_ms=4.0, tokens_per_event=tokens_per_event)
    try:
        path = tmp / f"{name}.jsonl"
        levels = run_fixed(server, VLLMAdapter(), 48, path, {f"p{i}": [100 + i, 1, 2] for i in range(12)}, [2],
                           repetitions=2, reuse=False)
        return path, summarize(levels, VLLMAdapter()).metrics
    finally:
        server.stop()


def client_records(tmp: Path, tokens_per_event: int, name: str) -> list[dict]:
    return load_records(client_run(tmp, tokens_per_event, name)[0])


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
    a = {k: v for k, v in verdicts.items() if k.startswith("A: n-gram")}
    b = {k: v for k, v in verdicts.items() if k.startswith("B: EAGLE-3")}
    assert len(a) == 6 and len(b) == 8
    assert all(v["contaminated"] and v["verdict"].startswith(CONTAMINATED) for v in a.values())
    assert all(v["decision"] == CONTAMINATED for v in a.values())
    assert not any(v["contaminated"] for v in b.values())
    assert all(v["decision"] in {"pays", "does not pay", "depends", "inconclusive"} for v in b.values())
    # 8-10 prompts per level: every configuration carries the warning, on the page too
    assert all(v["warning"].startswith("too few prompts to decide on") for v in verdicts.values())
    assert text.count('<p class="warn"><b>Warning</b>') >= len(verdicts)
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


# ---------------------------------------------------------------- forecast beside the measurement

FORECASTS = {"A": [(0.80, 0.70, 0.85), (0.90, 0.80, 0.95)],   # two runs: mean 0.85 [0.75, 0.90], does not pay
             "B": [None],                                      # no forecast was made
             "C": [(1.90, 1.60, 2.30)]}                        # pays, as measured
K = {"A": 4, "B": 2, "C": 8}


def log_measured(client: MlflowClient, exp: str, name: str, records: Path, metrics: dict[str, float],
                 params: dict[str, str], tags: dict[str, str]) -> str:
    run_id = client.create_run(exp, run_name=name, tags={"specws.mode": "measure", "specws.workload": "loopback",
                                                         **tags}).info.run_id
    for k, v in {"engine.name": "vllm", **params}.items():
        client.log_param(run_id, k, v)
    client.log_batch(run_id, metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()])
    client.log_artifact(run_id, str(records), "records")
    client.set_terminated(run_id, "FINISHED")
    return run_id


def forecast_metrics(forecast: tuple[float, float, float] | None) -> dict[str, float]:
    """What forecast_check logs on a measured run at c = 2 (error and coverage are the report's own business)."""
    return {} if forecast is None else dict(zip(("forecast_speedup_c2", "forecast_speedup_low_c2",
                                                 "forecast_speedup_high_c2"), forecast, strict=True))


@pytest.fixture(scope="module")
def forecast_store(tmp_path_factory) -> tuple[MlflowClient, str, Path, float]:
    """A baseline and options A (2 runs, each with a forecast), B (no forecast), C (a forecast that agrees), all
    over the same loopback records (two tokens per event: about twice the baseline's rate); returns the client,
    the store's URI, a folder and the measured paired speedup computed without the report."""
    tmp = tmp_path_factory.mktemp("forecast")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("forecast@loopback", artifact_location=str(tmp / "artifacts"))
    base_path, base_metrics = client_run(tmp, 1, "base")
    fast_path, fast_metrics = client_run(tmp, 2, "fast")
    base_id = log_measured(client, exp, "baseline", base_path, base_metrics, {"spec.method": "none"},
                           {"specws.option": "baseline"})
    for option, forecasts in FORECASTS.items():
        for i, f in enumerate(forecasts):
            log_measured(client, exp, f"{option}-{i}", fast_path, fast_metrics | forecast_metrics(f),
                         {"spec.method": "ngram", "spec.num_draft_tokens": str(K[option])},
                         {"specws.option": option, "specws.baseline_run_id": base_id})
    (row,) = category_rows(load_records(fast_path), load_records(base_path), acceptor("vllm"))
    return client, uri, tmp, row["speedup"]


def test_report_shows_the_forecast_beside_the_measurement(forecast_store) -> None:
    client, uri, tmp, measured = forecast_store
    assert 1.4 < measured < 2.2
    assert main(["forecast@loopback", "--tracking-uri", uri, "--out", str(tmp / "reports")]) == 0
    exp = client.get_experiment_by_name("forecast@loopback")
    (report_run,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    verdicts = json.loads(Path(client.download_artifacts(report_run.info.run_id, "report/verdicts.json",
                                                         str(tmp))).read_text())
    entry = {key.split(":")[0]: v for key, v in verdicts.items()}
    a, b, c = (entry[o]["points"]["2"] for o in "ABC")
    # A: the mean of its two runs' forecasts, the error against the report's pooled paired speedup
    assert a["speedup"] == pytest.approx(measured) and a["verdict"] == "pays" and a["forecasts"] == 2
    assert (a["forecast"], a["forecast_low"], a["forecast_high"]) == pytest.approx((0.85, 0.75, 0.90))
    assert a["forecast_error"] == pytest.approx(0.85 / measured - 1.0) and a["forecast_error"] < -0.4
    assert a["forecast_verdict"] == "does not pay"
    assert (f"forecast disagrees at c = 2 (forecast 0.85x [0.75, 0.90] does not pay, measured {measured:.2f}x pays)"
            in entry["A"]["verdict"])
    assert entry["A"]["verdict"].startswith("pays at c = 2;") and entry["A"]["decision"] == "pays"
    # B: no forecast; C: a forecast that agrees is not named
    assert b["forecast"] is None and b["forecast_error"] is None and b["forecast_verdict"] is None
    assert c["forecast_error"] == pytest.approx(1.9 / measured - 1.0) and c["forecast_verdict"] == "pays"
    assert not any("forecast disagrees" in entry[o]["verdict"] for o in "BC")
    html = (tmp / "reports" / "report-forecast_loopback.html").read_text()
    rows = table_rows(html)
    assert rows["A"]["forecast [95 % interval]"] == "0.85x [0.75, 0.90]"
    assert rows["A"]["forecast error"] == f"{100 * (0.85 / measured - 1):+.1f} %"
    assert rows["C"]["forecast [95 % interval]"] == "1.90x [1.60, 2.30]"
    assert rows["B"]["forecast [95 % interval]"] == rows["B"]["forecast error"] == "-"
    assert "post-hoc model" in html and "forecast disagrees at c = 2" in html


def table_rows(html: str) -> dict[str, dict[str, str]]:
    """The Measurements table: option's first word -> {column header: cell text}."""
    table = html.split("<h2>Measurements</h2>")[1].split("</table>")[0]
    head, *rows = re.findall(r"<tr>(.*?)</tr>", table)
    names = re.findall(r"<th>(.*?)</th>", head)
    cells = [[re.sub(r"<.*?>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)] for row in rows]
    return {row[0].split(":")[0]: dict(zip(names, row, strict=True)) for row in cells}


def test_figure_draws_the_forecast_as_hollow_squares(forecast_store) -> None:
    client, uri, tmp, measured = forecast_store
    options, runs, _, _ = select_runs(client, "forecast@loopback")
    fig = figure(build_series(client, options, runs), "forecast test")
    fig.savefig(tmp / "figure.png", dpi=80)
    (ax,) = fig.axes
    squares = [line for line in ax.lines if line.get_marker() == "s" and line.get_markerfacecolor() == "none"]
    assert sorted(float(y) for line in squares for y in line.get_ydata()) == pytest.approx([0.85, 1.9])
    dots = [float(y) for line in ax.lines if line.get_marker() == "o" for y in line.get_ydata()]
    assert dots == pytest.approx([measured] * 3)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "forecast before the run (95 %)" in labels and "post-hoc model" in labels
    assert "forecast made before the run: hollow squares" in fig._suptitle.get_text()
