"""The decision report's telemetry: per run, GPU power and utilisation over its measured levels beside each level's
throughput and energy per output token, from the run's own samples (experiments.harness.telemetry: TABLE, WINDOWS).
Where no run has GPU samples (a CPU host, or runs recorded before telemetry existed) the section is one line, "no GPU
telemetry on this host: <why>" (the runs' `telemetry.gpu` tags, each reason once); the figure of a run without GPU
samples shows the host's CPU utilisation instead."""
from __future__ import annotations

import csv
import json
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from experiments.analysis.report.inputs import _lookup_errors
from experiments.harness.telemetry import HOST, SAMPLE_INTERVAL_S, TABLE, TAG, WINDOWS

MAX_RUNS = 8          # rows of the figure; the table lists every run
LEVEL_KEYS = ("output_tok_s", "energy_per_token_j", "gpu_power_w_mean", "gpu_util_pct_mean", "host_cpu_util_pct_mean")


@dataclass
class RunTelemetry:
    label: str
    status: str                                   # the run's telemetry.gpu tag
    samples: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)
    levels: dict[int, dict[str, float]] = field(default_factory=dict)   # the run's per-level metrics

    @property
    def has_gpu(self) -> bool:
        return any(s["device"] != HOST for s in self.samples)

    def series(self, metric: str, gpu: bool, reduce) -> tuple[list[float], list[float]]:
        """(times, values) of `metric` over the GPUs (reduced across them per sample time) or of the host."""
        by_time: dict[float, list[float]] = defaultdict(list)
        for s in self.samples:
            if s["metric"] == metric and (s["device"] != HOST) == gpu:
                by_time[float(s["t_s"])].append(float(s["value"]))
        times = sorted(by_time)
        return times, [reduce(by_time[t]) for t in times]


def telemetry_of(client, runs: list) -> list[RunTelemetry]:
    """Each run's telemetry in start order (samples and windows empty where it recorded none)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in sorted(runs, key=lambda r: r.info.start_time):
            m = run.data.metrics
            levels = {c: {k: m[f"{k}_c{c}"] for k in LEVEL_KEYS if f"{k}_c{c}" in m} for c in _levels(m)}
            t = RunTelemetry(f"{run.info.run_name} ({run.info.run_id[:8]})",
                             run.data.tags.get(TAG, "no telemetry recorded"), levels=levels)
            t.samples, t.windows = _artifacts(client, run.info.run_id, Path(tmp))
            out.append(t)
    return out


def _levels(metrics: dict) -> list[int]:
    return sorted({int(k.rsplit("_c", 1)[1]) for k in metrics
                   if k.startswith("output_tok_s_c") and k.rsplit("_c", 1)[1].isdigit()})


def _artifacts(client, run_id: str, tmp: Path) -> tuple[list[dict], list[dict]]:
    try:
        table = Path(client.download_artifacts(run_id, TABLE, str(tmp / run_id)))
        windows = Path(client.download_artifacts(run_id, WINDOWS, str(tmp / run_id)))
    except _lookup_errors():   # recorded before telemetry, or its upload failed
        return [], []
    with table.open() as f:
        samples = list(csv.DictReader(f))
    return samples, json.loads(windows.read_text())["windows"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _shade_levels(ax: Any, t: RunTelemetry) -> None:
    for i, w in enumerate(t.windows):
        if w["end_s"] is None:
            continue
        ax.axvspan(w["start_s"], w["end_s"], color="0.85" if i % 2 == 0 else "0.93", zorder=0)
        lv = t.levels.get(int(w["concurrency"]), {})
        text = f"c={w['concurrency']}\n{_num(lv.get('output_tok_s'), '{:.3g} tok/s')}"
        if "energy_per_token_j" in lv:
            text += f"\n{lv['energy_per_token_j']:.3g} J/tok"
        ax.text((w["start_s"] + w["end_s"]) / 2, 0.97, text, transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=7)


def _run_panel(ax: Any, t: RunTelemetry) -> None:
    _shade_levels(ax, t)
    if t.has_gpu:
        ax.plot(*t.series("power_w", True, sum), color="tab:red", lw=1.2, label="GPU power (W, all GPUs)")
        ax.set_ylabel("GPU power (W)", color="tab:red")
        util = ax.twinx()
        util.plot(*t.series("util_pct", True, _mean), color="tab:blue", lw=1.0, label="GPU utilisation (%)")
        util.set_ylim(0, 105)
        util.set_ylabel("GPU utilisation (%)", color="tab:blue")
        ax.set_title(t.label, fontsize=9)
    else:
        ax.plot(*t.series("cpu_util_pct", False, _mean), color="tab:green", lw=1.0)
        ax.set_ylim(0, 105)
        ax.set_ylabel("host CPU (%)", color="tab:green")
        ax.set_title(f"{t.label}: no GPU telemetry ({t.status})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the first measured level (warm-ups between levels not sampled)")
    ax.grid(alpha=0.3)


def telemetry_figure(runs: list[RunTelemetry]) -> Any | None:
    """One row per run with samples (at most MAX_RUNS): power and utilisation over time, each level shaded and
    labelled with its throughput and energy per token; None when no run has samples."""
    shown = [t for t in runs if t.samples][:MAX_RUNS]
    if not shown:
        return None
    from experiments.tracking.plots import plt
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 2.8 * len(shown)), squeeze=False, layout="constrained")
    for ax, t in zip(axes[:, 0], shown, strict=True):
        _run_panel(ax, t)
    return fig


def no_gpu_line(runs: list[RunTelemetry]) -> str:
    """The one line for runs without GPU telemetry: why, each distinct reason once ("off: " left off)."""
    reasons = dict.fromkeys(t.status.removeprefix("off: ") for t in runs)
    return f"no GPU telemetry on this host: {'; '.join(reasons) or 'no runs'}"


def html_section(runs: list[RunTelemetry], png: bytes | None) -> str:
    """The Telemetry section: the figure and a row per run and level; one line where no run has GPU samples."""
    import base64
    if not any(t.has_gpu for t in runs):
        return f"<p>{escape(no_gpu_line(runs))}.</p>"
    rows = []
    for t in runs:
        gpu = "GPU" if t.has_gpu else "no GPU telemetry"
        for c, lv in sorted(t.levels.items()) or [(None, {})]:
            cells = [t.label, f"{gpu}: {t.status}", "-" if c is None else c,
                     _num(lv.get("output_tok_s"), "{:.4g}"), _num(lv.get("energy_per_token_j"), "{:.4g}"),
                     _num(lv.get("gpu_power_w_mean"), "{:.4g}"), _num(lv.get("gpu_util_pct_mean"), "{:.3g}"),
                     _num(lv.get("host_cpu_util_pct_mean"), "{:.3g}")]
            rows.append("<tr>" + "".join(f"<td>{escape(str(x))}</td>" for x in cells) + "</tr>")
    img = "" if png is None else (f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}" '
                                  'style="max-width:100%">')
    return (f"<h2>Telemetry</h2>{img}<table><tr><th>run</th><th>telemetry</th><th>concurrency</th>"
            "<th>output tok/s</th><th>energy per output token (J)</th><th>mean GPU power (W, all GPUs)</th>"
            f"<th>mean GPU utilisation (%)</th><th>host CPU (%)</th></tr>{''.join(rows)}</table>"
            f"<p>Sampled every {SAMPLE_INTERVAL_S} s while each measured level ran (warm-ups and server start left "
            "out), through NVML on GPU hosts; energy from NVML's energy counter where the GPU has one, else the "
            "power samples.</p>")
