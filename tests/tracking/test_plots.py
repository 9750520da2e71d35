"""The run's own plots a reader can trust: throughput per level from zero, with intervals where they are given and the
workload and prompts per level in the title; the accept-length histogram counts whole requests (its data from the
workspace client's records against the loopback server, through the workspace's own binning)."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_fixed

from experiments.analysis.categories import accept_length_hist, acceptor, hist_figure
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.tracking.plots import plt, throughput_vs_concurrency
from experiments.tracking.records import load_records
from tests.helpers.loopback_server import start_loopback


def test_throughput_starts_at_zero_and_names_workload_prompts_and_intervals() -> None:
    fig = throughput_vs_concurrency({1: 36.0, 4: 41.0}, {1: 35.0, 4: 38.0}, "A: n-gram, 4 draft tokens",
                                    workload="quick (prompt set grounded)", prompts={1: 12, 4: 12},
                                    intervals={1: (34.0, 38.0), 4: (39.0, 43.5)})
    (ax,) = fig.axes
    assert ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] > 43.5
    assert ax.get_title() == "Throughput vs concurrency on quick (prompt set grounded), 12 prompts per level"
    bars = [c for c in ax.collections if c.get_segments()]
    (option_bars,) = bars                       # the baseline was given no intervals: no bars drawn for it
    assert [tuple(seg[:, 1]) for seg in option_bars.get_segments()] == [(34.0, 38.0), (39.0, 43.5)]
    plt.close(fig)
    bare = throughput_vs_concurrency({1: 36.0, 4: 41.0}, None, "A")   # what a caller without them gets
    assert bare.axes[0].get_ylim()[0] == 0.0 and bare.axes[0].get_title() == "Throughput vs concurrency"
    plt.close(bare)


def test_the_accept_length_histogram_counts_whole_requests(tmp_path: Path) -> None:
    server = start_loopback(ttft_ms=2.0, itl_ms=1.0, tokens_per_event=3)
    try:
        path = tmp_path / "records.jsonl"
        run_fixed(server, VLLMAdapter(), 24, path, {f"p{i}": [100 + i, 1, 2] for i in range(3)}, [1])
    finally:
        server.stop()
    hist = accept_length_hist(load_records(path), acceptor("vllm"))
    assert sum(len(v) for v in hist["values"].values()) == 3
    fig = hist_figure(hist)
    fig.canvas.draw()
    (ax,) = fig.axes
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert len(ticks) >= 2 and all(t == pytest.approx(round(t)) for t in ticks)
    plt.close(fig)
