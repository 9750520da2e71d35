"""The decision report's figure: per workload, speedup vs concurrency of each option configuration, measured
(filled dots, 95 % CI), the forecast made before the run (hollow squares, thin bars: its 95 % interval) just
right of each measured point, and the post-hoc model (hollow diamonds, evaluated with the run's own acceptance);
the legend and the key name only the kinds drawn; the speedup axis from zero; each panel titled by its workload
and the prompts per level."""
from __future__ import annotations

import textwrap
from typing import Any

import numpy as np

from experiments.analysis.words import workload_words

GRAY = "0.35"
BAND = 0.7                    # octaves around a level shared by its configurations' points
# marker kind -> (the suptitle's words, the legend's entry, its marker)
KINDS = {"measured": ("measured: filled dots, 95 % CI", "measured (95 % CI)", "o"),
         "forecast": ("forecast made before the run: hollow squares, 95 % interval", "forecast before the run (95 %)",
                      "s"),
         "model": ("post-hoc model (the run's own acceptance): hollow diamonds", "post-hoc model", "D")}


def drawn(series: list) -> list[str]:
    """The marker kinds the figure draws for `series`: measured always, the forecast and the post-hoc model where
    some point has one."""
    points = [p for s in series for p in s.points.values()]
    return ["measured"] + [kind for kind, has in (("forecast", any(p.forecast is not None for p in points)),
                                                  ("model", any(p.predicted for p in points))) if has]


def _key_handles(kinds: list[str]) -> list:
    """Legend entries for the marker kinds drawn, in gray, after the configurations' colours."""
    from matplotlib.lines import Line2D
    return [Line2D([], [], color=GRAY, marker=KINDS[k][2], mfc=GRAY if k == "measured" else "none",
                   ls="-" if k == "measured" else "none", label=KINDS[k][1]) for k in kinds]


def _measured(ax: Any, s: Any, x: np.ndarray, color: str) -> None:
    cs = sorted(s.points)
    y = np.array([s.points[c].speedup for c in cs])
    err = np.array([[y[j] - s.points[c].low for j, c in enumerate(cs)],
                    [s.points[c].high - y[j] for j, c in enumerate(cs)]])
    label = s.label + (" [contaminated]" if s.contaminated else "")
    ax.errorbar(x, y, yerr=np.clip(err, 0, None), fmt="o:" if s.contaminated else "o-", color=color, capsize=4,
                label=label)


def _forecast(ax: Any, s: Any, x: np.ndarray, color: str) -> None:
    shown = [(xj, p) for xj, p in zip(x, (s.points[c] for c in sorted(s.points)), strict=True)
             if p.forecast is not None]
    if not shown:
        return
    y = np.array([p.forecast for _, p in shown])
    lo = np.array([p.forecast - p.forecast_low if p.forecast_low is not None else 0.0 for _, p in shown])
    hi = np.array([p.forecast_high - p.forecast if p.forecast_high is not None else 0.0 for _, p in shown])
    ax.errorbar([xj for xj, _ in shown], y, yerr=np.clip([lo, hi], 0, None), fmt="s", mfc="none", ms=7,
                color=color, elinewidth=0.8, capsize=2)


def _model(ax: Any, s: Any, x: np.ndarray, color: str) -> None:
    shown = [(xj, s.points[c].predicted) for xj, c in zip(x, sorted(s.points), strict=True) if s.points[c].predicted]
    if shown:
        ax.plot(*zip(*shown, strict=True), "D", mfc="none", color=color, ms=9)


def _panel(ax: Any, mine: list, colors: list[str], title: str) -> None:
    levels = sorted({c for s in mine for c in s.points})
    forecasts = any(p.forecast is not None for s in mine for p in s.points.values())
    width = min(0.2 if forecasts else 0.06, BAND / len(mine))     # octaves between configurations
    for i, s in enumerate(mine):
        color = colors[i % len(colors)]
        x = np.array(sorted(s.points), dtype=float) * 2.0 ** (width * (i - (len(mine) - 1) / 2))  # side by side
        _measured(ax, s, x, color)
        _forecast(ax, s, x * 2.0 ** (0.45 * width), color)      # just right of its measured point
        _model(ax, s, x, color)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_ylim(bottom=0)       # from zero: the distance to 1 (no speedup) is drawn to scale
    ax.set_xscale("log", base=2)
    ax.set_xlim(levels[0] / 2.0 ** BAND, levels[-1] * 2.0 ** BAND)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup vs baseline (output tok/s)")
    ax.set_title("\n".join(textwrap.wrap(title, 60)))
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + _key_handles(drawn(mine)), fontsize=7)


def panel_titles(series: list) -> dict[str, str]:
    """workload -> its panel's title (`series`: report.OptionSeries or pareto.ParetoPoint): the workload's name,
    the prompt set it sends in parentheses where that has another name (experiments.analysis.words)."""
    return {s.workload: workload_words(s.workload, getattr(s, "prompt_set", None)) for s in series}


def sample_words(series: list) -> str:
    """The prompts per level behind `series`' points ("12 prompts per level", "8-16 prompts per level"); empty
    where no point counted its prompts."""
    counts = sorted({p.prompts for s in series for p in s.points.values() if p.prompts})
    if not counts:
        return ""
    return f"{counts[0] if len(counts) == 1 else f'{counts[0]}-{counts[-1]}'} prompts per level"


def _wrapped(text: str, width_in: float, fontsize: float) -> str:
    """`text` wrapped to the figure's width (a character is about 0.55 em wide), each line on its own."""
    chars = max(20, int(width_in * 72 / (fontsize * 0.55)))
    return "\n".join(line for part in text.split("\n") for line in textwrap.wrap(part, chars))


def figure(series: list, title: str) -> Any:
    """`series`: report.OptionSeries; one panel per workload, titled by its prompt set."""
    from experiments.tracking.plots import plt
    workloads = sorted({s.workload for s in series})
    titles = panel_titles(series)
    ncols = min(2, len(workloads))
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.8 * nrows + 0.6), squeeze=False,
                             layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    for ax, workload in zip(axes.flat, workloads, strict=False):
        mine = [s for s in series if s.workload == workload]
        n = sample_words(mine)
        _panel(ax, mine, colors, f"{titles[workload]}: {n}" if n else titles[workload])
    size = 9 if ncols == 1 else 11
    key = "; ".join(KINDS[k][0] for k in drawn(series))
    fig.suptitle(_wrapped(f"{title}\n{key}", 7 * ncols, size), fontsize=size)
    return fig
