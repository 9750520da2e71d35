"""The report's telemetry section from a run's stored samples: the workspace client measures two levels against the
loopback token server with the level sampler hooked in (this machine has no NVML: the host's CPU is what it reads),
the workspace's exporter writes the run into a temporary MLflow store, and the report reads it back from there; the
report's section on a host without GPU telemetry is one line with the reason once."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.report.telemetry import html_section, telemetry_figure, telemetry_of
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.harness.client import RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.summary import add_level_metrics, summarize
from experiments.harness.telemetry import TABLE, TAG, WINDOWS, LevelTelemetry
from experiments.harness.workloads.sampling import plan_visits
from experiments.tracking.export import Measurement, export
from experiments.tracking.uploads import Uploads
from tests.helpers.loopback_server import start_loopback


def _measured_run(client: MlflowClient, exp: str, tmp: Path) -> str:
    convs, render = fixed_prompts({f"p{i}": [100 + i, 1, 2] for i in range(4)})
    plan = plan_visits(convs, [1, 2], 1, 0, 0, True)
    telemetry = LevelTelemetry.open(interval_s=0.1)
    m = Measurement(tmp / "records.jsonl", option="loopback", tags={TAG: telemetry.status}, telemetry=telemetry)
    server = start_loopback(ttft_ms=5.0, itl_ms=20.0, tokens_per_event=1)
    try:
        runner = WorkloadRunner(server, SGLangAdapter(), "loopback", RequestSettings(24, 0.0, 0, 60), render,
                                m.records_path, telemetry=telemetry)
        m.summary = summarize(runner.run(plan), SGLangAdapter())
    finally:
        server.stop()
        telemetry.close()
    add_level_metrics(m.summary, telemetry.level_metrics({c: lv["output_tokens"]
                                                          for c, lv in m.summary.per_level.items()}))
    m.metrics = dict(m.summary.metrics)
    run_id = client.create_run(exp, run_name="loopback").info.run_id
    uploads = Uploads(client, run_id, m.records_path)
    export(client, run_id, m, uploads)
    uploads.raise_first()
    client.set_terminated(run_id)
    return run_id


def test_the_report_plots_a_runs_stored_telemetry_and_says_when_there_is_no_gpu(store: str, tmp_path: Path) -> None:
    client = MlflowClient(store)
    run_id = _measured_run(client, client.create_experiment("telemetry"), tmp_path)
    (t,) = telemetry_of(client, [client.get_run(run_id)])
    assert t.status.startswith("off: ") and not t.has_gpu
    assert [w["concurrency"] for w in t.windows] == [1, 2]
    times, cpu = t.series("cpu_util_pct", False, max)
    assert cpu and all(0.0 <= v <= 100.0 for v in cpu)
    # every sample lies inside a measured level's window, and the level metric is what the samples add up to: the
    # samples tile the window (the first interval from its start), so their time-weighted mean is the busy-CPU
    # counter's over the window, up to each sample's clipping at 100 %
    assert all(any(w["start_s"] - 0.001 <= x <= w["end_s"] + 0.001 for w in t.windows) for x in times)
    for w in t.windows:
        inside = [(float(s["t_s"]), float(s["value"])) for s in t.samples
                  if s["metric"] == "cpu_util_pct" and int(s["concurrency"]) == w["concurrency"]]
        edges = [w["start_s"]] + [x for x, _ in inside]
        weighted = sum((b - a) * v for a, b, (_, v) in zip(edges, edges[1:], inside, strict=False))
        level = t.levels[w["concurrency"]]
        assert level["host_cpu_util_pct_mean"] == pytest.approx(weighted / (edges[-1] - edges[0]), abs=2.0)
        assert level["output_tok_s"] > 0
    fig = telemetry_figure([t])
    (ax,) = fig.axes
    assert "no GPU telemetry" in ax.get_title() and ax.get_ylabel() == "host CPU (%)"
    assert len(ax.lines[0].get_xdata()) == len(times)
    labels = [txt.get_text() for txt in ax.texts]
    assert len(labels) == 2 and labels[0].startswith("c=1\n") and "tok/s" in labels[0]
    # the report's section on this host: one line, the reason once however many runs and levels say it
    html = html_section([t, t, t, t], b"png")
    reason = t.status.removeprefix("off: ")
    assert html == f"<p>no GPU telemetry on this host: {escape(reason)}.</p>" and html.count(escape(reason)) == 1


H200 = Path(__file__).parent / "data" / "h200_telemetry"   # the sampler's own files from an H200 (2026-12-03)


def test_a_run_with_gpu_samples_gets_power_and_utilisation_beside_its_levels(store: str, tmp_path: Path) -> None:
    """The sampler's artifacts as recorded on an H200 (idle 1.5 s as level 1, bf16 matmuls 2.5 s as level 8), stored
    in a run as the exporter stores them; the report plots GPU power and utilisation from them."""
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("h200")).info.run_id
    status = json.loads((H200 / "windows.json").read_text())["status"]
    client.set_tag(run_id, TAG, status)
    for name in (TABLE, WINDOWS):
        client.log_text(run_id, (H200 / Path(name).name).read_text(), name)
    (t,) = telemetry_of(client, [client.get_run(run_id)])
    assert t.has_gpu and t.status.startswith("on: NVML")
    times, power = t.series("power_w", True, sum)
    idle = [p for x, p in zip(times, power, strict=True) if x <= t.windows[0]["end_s"]]
    busy = [p for x, p in zip(times, power, strict=True) if x >= t.windows[1]["start_s"] + 0.5]
    assert max(idle) < min(busy)   # the matmuls drew more power than the idle level, as recorded
    fig = telemetry_figure([t])
    power_ax, util_ax = fig.axes
    assert "no GPU telemetry" not in power_ax.get_title()
    assert power_ax.get_ylabel() == "GPU power (W)" and util_ax.get_ylabel() == "GPU utilisation (%)"
    assert list(power_ax.lines[0].get_ydata()) == power
    assert [txt.get_text().split("\n")[0] for txt in power_ax.texts] == ["c=1", "c=8"]
    html = html_section([t], None)
    assert "no GPU telemetry" not in html and "GPU: on: NVML" in html and "<h2>Telemetry</h2>" in html
