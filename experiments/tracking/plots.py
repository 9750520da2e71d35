"""Figures a person would rather look at than read."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
from typing import TYPE_CHECKING, Any  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

if TYPE_CHECKING:
    from experiments.engines.base import Acceptance


Intervals = dict[int, tuple[float, float]]


def _line(ax, values: dict[int, float], intervals: Intervals | None, fmt: str, **kw) -> None:
    """A series over its levels, with error bars where `intervals` has the level's (low, high)."""
    levels = sorted(values)
    y = np.array([values[c] for c in levels], dtype=float)
    known = intervals or {}
    err = np.array([[y[i] - known[c][0] if c in known else 0.0 for i, c in enumerate(levels)],
                    [known[c][1] - y[i] if c in known else 0.0 for i, c in enumerate(levels)]])
    ax.errorbar(levels, y, yerr=np.clip(err, 0, None) if known else None, fmt=fmt, capsize=4 if known else 0, **kw)


def _sample_words(prompts: dict[int, int] | None) -> str:
    counts = sorted(set((prompts or {}).values()))
    if not counts:
        return ""
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f", {n} prompts per level"


def throughput_vs_concurrency(option: dict[int, float], baseline: dict[int, float] | None, label: str,
                              workload: str | None = None, prompts: dict[int, int] | None = None,
                              intervals: Intervals | None = None,
                              baseline_intervals: Intervals | None = None) -> Figure:
    """Output tok/s per concurrency level of an option (and its baseline), the y-axis from zero; 95 % intervals
    where given (level -> (low, high)); the workload and the prompts per level in the title where given."""
    fig, ax = plt.subplots(figsize=(6, 4))
    levels = sorted(option)
    _line(ax, option, intervals, "o-", label=label)
    if baseline:
        _line(ax, baseline, baseline_intervals, "s--", color="gray", label="baseline")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s" + (" (95 % CI)" if intervals else ""))
    where = f" on {workload}" if workload else ""
    ax.set_title(f"Throughput vs concurrency{where}{_sample_words(prompts)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def accept_length_histogram(hist: dict[str, Any]) -> Figure:
    """Per-request accept lengths per level (experiments.analysis.categories.accept_length_hist); the count axis
    in whole requests."""
    fig, ax = plt.subplots(figsize=(6, 4))
    edges = hist["bin_edges"]
    for c, v in hist["values"].items():
        ax.hist(v, bins=edges, histtype="step", lw=1.5, label=f"c={c} ({len(v)} requests)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("accept length per request (tokens per verification step)")
    ax.set_ylabel("requests")
    ax.set_title("Accept-length distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def acceptance_figure(acc: Acceptance) -> Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    lengths = sorted(acc.length_histogram)
    left.bar(lengths, [acc.length_histogram[n] for n in lengths], color="tab:blue")
    left.set_xticks(lengths)
    left.set_xlabel("tokens emitted per verification step")
    left.set_ylabel("fraction of steps")
    left.set_title(f"Accept length (mean {acc.accept_length:.2f})")
    positions = range(1, len(acc.per_position) + 1)
    right.bar(positions, acc.per_position, color="tab:green")
    right.set_xticks(list(positions))
    right.set_ylim(0, 1)
    right.set_xlabel("draft position")
    right.set_ylabel("P(accepted)")
    right.set_title(f"Per-position acceptance (rate {acc.acceptance_rate:.2f})")
    fig.tight_layout()
    return fig


def sweep_figure(param: str, rows: list[dict]) -> Figure:
    """rows: {param value, speedup_vs_baseline, accept_length} per child run, x sorted."""
    rows = sorted(rows, key=lambda r: r["x"])
    xs = [r["x"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r.get("speedup_vs_baseline", float("nan")) for r in rows], "o-", color="tab:red",
            label="speedup vs baseline")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel(param)
    ax.set_ylabel("speedup (single stream)", color="tab:red")
    twin = ax.twinx()
    twin.plot(xs, [r.get("accept_length", float("nan")) for r in rows], "s--", color="tab:blue",
              label="accept length")
    twin.set_ylabel("accept length", color="tab:blue")
    ax.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    ax.set_title(f"Sweep over {param}")
    fig.tight_layout()
    return fig
