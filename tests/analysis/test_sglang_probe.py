"""SGLang verification-cost probe (experiments/analysis/speedup/fit.py): runs whose records the workspace client wrote
against the loopback server streaming SGLang /generate events on a known step schedule, summarised by the
workspace's summary code and logged into a temporary MLflow store; the probe must recover the schedule."""
from __future__ import annotations

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.speedup.fit import error_table, fit_eagle_cost, fit_verify_cost, sglang_step_points
from tests.helpers.loopback_runs import B_TOK, DRAFT, OVERHEAD, log_loopback_run, step_ms


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[MlflowClient, str, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("probe")
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("probe@loopback", artifact_location=str(tmp / "artifacts"))
    ids = {"base": log_loopback_run(client, exp, tmp, "baseline", {}, step_ms(1), 1)}
    for k in (2, 4, 8):   # SGLang NGRAM verifies num_draft_tokens per step; 2 tokens accepted per step here
        params = {"spec.method": "ngram", "spec.num_draft_tokens": str(k)}
        ids[f"ngram{k}"] = log_loopback_run(client, exp, tmp, f"ngram{k}", params, step_ms(k), 2, ids["base"])
    ids["eagle"] = log_loopback_run(client, exp, tmp, "eagle3", {"spec.method": "eagle3", "spec.num_steps": "3",
                                                        "spec.num_draft_tokens": "4"}, step_ms(4, 3), 2, ids["base"])
    return client, exp, ids


def test_probe_recovers_the_step_schedule(store) -> None:
    client, exp, ids = store
    points = sglang_step_points(client, client.search_runs([exp]))
    assert {p.verified for p in points.values()} == {1.0, 2.0, 4.0, 8.0}
    # every speculative run is measured against its own paired baseline's step time
    assert all(p.base_step_ms == points[ids["base"]].step_ms for k, p in points.items() if k != ids["base"])
    fit = fit_verify_cost(points)
    assert fit is not None and sorted(fit.runs) == sorted(v for k, v in ids.items() if k.startswith("ngram"))
    # three draft lengths at c = 1: the fixed speculative-step overhead and the per-token cost are told apart
    assert fit.b_tok_ms == pytest.approx(B_TOK, abs=0.3)
    assert fit.spec_overhead_ms == pytest.approx(OVERHEAD, abs=0.8)
    assert fit.spec_overhead_seq_ms == 0.0          # one concurrency: not told apart from the fixed overhead
    assert fit.excess_ms(1, 4) == pytest.approx(OVERHEAD + 3 * B_TOK, abs=0.6) and fit.excess_ms(1, 1) == 0.0
    eagle = fit_eagle_cost(points, fit)           # the only EAGLE-3 run: NGRAM's overhead, its draft cost
    assert not eagle.own and eagle.draft_ms == pytest.approx(DRAFT, abs=0.35)
    assert fit_eagle_cost(points, fit, exclude=ids["eagle"]) is None
    # one draft length only (today's H200 store): a line through q = 1 and q = 4, the overhead inside b_tok
    only4 = {k: p for k, p in points.items() if p.verified in (1.0, 4.0) and p.method != "eagle3"}
    line = fit_verify_cost(only4)
    assert line.spec_overhead_ms == 0.0
    assert line.b_tok_ms == pytest.approx((OVERHEAD + 3 * B_TOK) / 3, abs=0.3)
    assert fit_verify_cost({k: p for k, p in points.items() if p.verified == 1.0}) is None


def test_error_table_uses_the_probe_leave_one_out(store) -> None:
    client, exp, ids = store
    mlflow.set_tracking_uri(client.tracking_uri)
    rows = {r["run"]: r for r in error_table(client, "probe@loopback")}
    flat = {r["run"]: r for r in error_table(client, "probe@loopback", use_probe=False)}
    for k in (2, 4, 8):
        row = rows[ids[f"ngram{k}"]]
        assert "SGLang probe over 2 runs" in row["note"] and not row["flag"]
        assert row["rel_error"] < 0.12, row            # b_tok = b_seq would be far off: checked below
        assert flat[ids[f"ngram{k}"]]["rel_error"] > row["rel_error"]
    eagle = rows[ids["eagle"]]
    assert eagle["rel_error"] < 0.15 and eagle["draft_step_cost"] is None  # no other EAGLE-3 run: assumed cost
