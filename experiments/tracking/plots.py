"""Figures a person would rather look at than read."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
from typing import TYPE_CHECKING  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

if TYPE_CHECKING:
    from experiments.engines.base import Acceptance


def throughput_vs_concurrency(option: dict[int, float], baseline: dict[int, float] | None,
                              label: str) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 4))
    levels = sorted(option)
    ax.plot(levels, [option[c] for c in levels], "o-", label=label)
    if baseline:
        b = sorted(baseline)
        ax.plot(b, [baseline[c] for c in b], "s--", color="gray", label="baseline")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
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
    ax.set_title(f"Sweep over {param}")
    fig.tight_layout()
    return fig
