"""Throughput against per-user speed on the recorded H200 lease of 2026-12-01 (tests/analysis/leases.py), where no
speculative setting paid at any level: no speculation has the highest aggregate and per-user rates at every level,
so it alone makes the frontier of every workload."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.categories import ALL, acceptor, category_rows
from experiments.analysis.pareto import as_json, frontier, pareto_figure, pareto_points
from experiments.analysis.recommend.decision import NO_SPECULATION
from experiments.analysis.report.inputs import Records, select_runs
from tests.analysis import leases
from tests.analysis.leases import H200_EXPERIMENT

h200_store = leases.h200_store


def test_frontier_keeps_the_points_no_other_beats_in_both() -> None:
    x, y = np.array([1.0, 2.0, 3.0, 2.0, 1.0, 3.0]), np.array([5.0, 4.0, 1.0, 3.0, 1.0, 1.0])
    assert frontier(x, y).tolist() == [True, True, True, False, False, True]    # ties on both: neither beats


@pytest.fixture(scope="module")
def measured(h200_store: str):
    client = MlflowClient(h200_store)
    options, all_runs, _, _ = select_runs(client, H200_EXPERIMENT)
    records = Records(client)
    return client, options, all_runs, records, pareto_points(options, all_runs, records)


def test_points_are_the_runs_levels_and_no_speculation_makes_the_frontier(measured) -> None:
    client, options, all_runs, records, points = measured
    chat = [p for p in points if p.workload == "chat"]
    assert len(chat) == 15 and {p.load for p in chat} == {"c 1", "c 4", "c 8"}    # 4 settings + baseline, 3 levels
    rows = as_json(points)["points"]
    on = {(r["workload"], r["setting"]) for r in rows if r["frontier_per_user"] or r["frontier_tpot"]}
    assert {s for _, s in on} == {NO_SPECULATION} and {w for w, _ in on} == {"chat", "grounded", "mixed"}
    # each point's numbers are its run's: the level's logged tok/s, and per user Σtokens / Σe2e as the category
    # rows compute it from the same records
    (run,) = [r for r in options if r.data.tags["specws.workload"] == "chat" and r.data.params["spec.num_draft_tokens"]
              == "8"]
    point = next(p for p in chat if p.setting == "A k=8" and p.concurrency == 4)
    assert point.aggregate_tok_s == pytest.approx(run.data.metrics["output_tok_s_c4"])
    assert point.tpot_p50_ms == pytest.approx(run.data.metrics["tpot_p50_ms_c4"])
    row = next(r for r in category_rows(records(run.info.run_id), None, acceptor("sglang"))
               if r["category"] == ALL and r["concurrency"] == 4)
    assert point.per_user_tok_s == pytest.approx(row["output_tok_s"])


def test_the_figure_draws_each_workload_with_its_frontier(measured) -> None:
    *_, points = measured
    fig = pareto_figure(points, "pareto")
    assert len(fig.axes) == 6
    ax = fig.axes[0]
    assert ax.get_title().startswith("chat") and ax.get_ylabel() == "tok/s per user"
    (line,) = [ln for ln in ax.lines if ln.get_label() == "frontier"]
    base = sorted(p.aggregate_tok_s for p in points if p.workload == "chat" and p.setting == NO_SPECULATION)
    assert list(line.get_xdata()) == pytest.approx(base)
