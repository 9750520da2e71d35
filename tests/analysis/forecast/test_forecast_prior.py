"""Forecasts as the recommendation's prior (experiments/analysis/forecast/prior.py): runs stored in a temporary
MLflow store as the forecast run logs them; a configuration ruled out at every level is skipped, one left open is
named with the command that measures it, one already measured is not repeated."""
from __future__ import annotations

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from experiments.analysis.forecast.prior import forecast_prior


def log_forecast(client: MlflowClient, exp: str, k: int, levels: dict[int, tuple[float, float, float, str]],
                 mode: str = "forecast") -> object:
    run = client.create_run(exp, tags={"specws.mode": mode, "specws.option": "A", "specws.workload": "quick"})
    rid = run.info.run_id
    for name, value in {"engine.name": "vllm", "spec.method": "ngram", "spec.num_draft_tokens": str(k)}.items():
        client.log_param(rid, name, value)
    metrics = []
    for c, (s, lo, hi, verdict) in levels.items():
        metrics += [Metric(f"forecast_speedup_c{c}", s, 0, 0), Metric(f"forecast_speedup_low_c{c}", lo, 0, 0),
                    Metric(f"forecast_speedup_high_c{c}", hi, 0, 0)]
        client.set_tag(rid, f"specws.forecast_verdict_c{c}", verdict)
    client.log_batch(rid, metrics=metrics)
    client.set_terminated(rid, "FINISHED")
    return client.get_run(rid)


def test_ruled_out_skipped_open_named_measured_left_alone(tmp_path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("prior", artifact_location=str(tmp_path / "a"))
    log_forecast(client, exp, 8, {1: (0.6, 0.5, 0.7, "does not pay"), 4: (0.5, 0.4, 0.6, "does not pay")})
    log_forecast(client, exp, 2, {1: (1.1, 0.9, 1.3, "inconclusive"), 4: (0.7, 0.6, 0.8, "does not pay")})
    log_forecast(client, exp, 4, {1: (1.5, 1.3, 1.7, "pays")})
    measured = log_forecast(client, exp, 4, {}, mode="measure")
    prior = forecast_prior(client, exp, [measured])
    assert set(prior) == {("quick", "A: n-gram, 8 draft tokens"), ("quick", "A: n-gram, 2 draft tokens")}
    assert prior[("quick", "A: n-gram, 8 draft tokens")].startswith("skipped: the forecast rules it out")
    open_line = prior[("quick", "A: n-gram, 2 draft tokens")]
    assert open_line.startswith("not measured") and "c=1 inconclusive" in open_line and "+option=A" in open_line
