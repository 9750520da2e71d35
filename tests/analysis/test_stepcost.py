"""Step-cost profiles and the forecast made from them (experiments/analysis/speedup/stepcost.py, forecast.py):
runs whose records the workspace client wrote against the loopback server streaming SGLang /generate events on a
known step schedule, logged into a temporary MLflow store; the fit must recover the schedule per CUDA-graph regime,
and a forecast from the baseline's records must land where the schedule puts the option."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.analysis.runs import run_config
from experiments.analysis.speedup.forecast import ForecastUnavailable, HostOutsideProfile, forecast
from experiments.analysis.speedup.offline_acceptance import RequestSteps, finished
from experiments.analysis.speedup.stepcost import (
    ProfileMissing,
    StepCostProfile,
    find_profile,
    fit_profile,
    key_of,
    level_steps,
    save_profile,
)
from experiments.tracking.records import run_records
from tests.helpers.loopback_runs import B_TOK, DRAFT, OVERHEAD, T1, log_loopback_run, step_ms

CAP = 1                                            # CUDA-graph batch limit: level 2 runs in the eager regime
TOKENS = 48


def log_run(client: MlflowClient, exp: str, tmp: Path, name: str, params: dict, itl_ms: float, per_event: int,
            baseline_id: str | None = None) -> str:
    tags = {"specws.site": "loop", "specws.model": "tiny", "specws.engine_version": "0.5.14"}
    args = str(["--cuda-graph-max-bs-decode", str(CAP)])
    return log_loopback_run(client, exp, tmp, name, {"site.engine_args.sglang": args, **params}, itl_ms, per_event,
                            baseline_id, levels=(1, 2), tokens=TOKENS, tags=tags)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[MlflowClient, str, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("stepcost")
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("tiny@loop", artifact_location=str(tmp / "artifacts"))
    ids = {"base": log_run(client, exp, tmp, "baseline", {}, step_ms(1), 1)}
    for k in (2, 4, 8):
        params = {"spec.method": "ngram", "spec.num_draft_tokens": str(k)}
        ids[f"ngram{k}"] = log_run(client, exp, tmp, f"ngram{k}", params, step_ms(k), 2, ids["base"])
    for steps in (1, 3):
        params = {"spec.method": "eagle3", "spec.num_steps": str(steps), "spec.topk": "1",
                  "spec.num_draft_tokens": str(steps + 1)}
        ids[f"eagle{steps}"] = log_run(client, exp, tmp, f"eagle{steps}", params, step_ms(steps + 1, steps), 2,
                                       ids["base"])
    return client, exp, ids


def profile_of(client, exp, ids, exclude=(), unit="base") -> StepCostProfile:
    runs = [r for r in client.search_runs([exp]) if r.info.run_id not in exclude
            and r.data.tags.get("specws.option") not in ("slow_base", "slow_ngram4", "far_base")]
    return fit_profile(key_of(client.get_run(ids["base"])), level_steps(client, runs, "loop"), CAP, unit=unit)


def test_fit_recovers_the_schedule_in_each_regime(store) -> None:
    client, exp, ids = store
    profile = profile_of(client, exp, ids, unit="ms")
    assert set(profile.regimes) == {"graphs", "eager"} and profile.graph_cap == CAP
    assert profile.regime(1)[0] == "graphs" and profile.regime(2)[0] == "eager"
    # the loopback streams each request on its own schedule whatever the batch: at c = 2 the per-token term
    # b_tok * c * (q - 1) carries the schedule's B_TOK with c = 2
    for c, name in ((1, "graphs"), (2, "eager")):
        regime = profile.regimes[name]
        assert regime.decode_ms(c) == pytest.approx(T1, rel=0.1)
        assert regime.b_tok_ms * c == pytest.approx(B_TOK, abs=0.3)
        assert regime.over_ms == pytest.approx(OVERHEAD, abs=0.8)
        assert regime.draft_ms == pytest.approx(DRAFT, abs=0.35)
        assert regime.excess("ngram", c, 4) == pytest.approx(OVERHEAD + 3 * B_TOK, abs=0.6)
        assert regime.excess("eagle3", c, 4, 3) == pytest.approx(step_ms(4, 3) - T1, abs=0.8)
        assert regime.residual_rel < 0.1
    # in baseline steps (the default): the same terms over the decode step they were measured beside
    relative = profile_of(client, exp, ids).regimes["graphs"]
    assert relative.unit == "base" and relative.over_ms == pytest.approx(OVERHEAD / T1, abs=0.8 / T1)
    assert relative.excess("ngram", 1, 4) * T1 == pytest.approx(OVERHEAD + 3 * B_TOK, abs=0.6)
    assert relative.host_range[0] == pytest.approx(1.0, abs=0.1) and relative.host_range[1] < 1.1


SLOW, FAR = 1.4, 3.0     # hosts slower than the profile's, inside and outside HOST_TOLERANCE


def slow_host(client: MlflowClient, tmp: Path, exp: str, factor: float, name: str) -> str:
    """A baseline on a host `factor` times slower, whose every step (decode and speculative) takes that much longer."""
    return log_run(client, exp, tmp, f"{name}_base", {}, step_ms(1) * factor, 1)


def test_step_costs_in_baseline_steps_carry_to_a_slower_host(store, tmp_path) -> None:
    """The profile of the fast host forecasts the slow host's n-gram run: in baseline steps within 10 %, in
    absolute ms too high (the excess stays as fast as the fast host's); a host three times slower than any the
    profile saw is refused, with the probe to run."""
    client, exp, ids = store
    base_id = slow_host(client, tmp_path, exp, SLOW, "slow")
    option_id = log_run(client, exp, tmp_path, "slow_ngram4", {"spec.method": "ngram", "spec.num_draft_tokens": "4"},
                        step_ms(4) * SLOW, 2, base_id)
    base, option = client.get_run(base_id), client.get_run(option_id)
    records = run_records(client, base_id)
    steps = [RequestSteps(len(r["output_token_ids"]) - 1, (len(r["output_token_ids"]) - 1) / 2, 1.0)
             for r in finished(records)]
    for unit, close in (("base", True), ("ms", False)):
        profile = profile_of(client, exp, ids, unit=unit)
        f = forecast(records, base.data.metrics, steps, run_config(option), profile).overall()[0]
        measured = option.data.metrics["output_tok_s_c1"] / base.data.metrics["output_tok_s_c1"]
        assert (f.speedup == pytest.approx(measured, rel=0.1)) is close, (unit, f.speedup, measured)
    far_id = slow_host(client, tmp_path, exp, FAR, "far")
    far_records = run_records(client, far_id)
    with pytest.raises(HostOutsideProfile, match="host outside the profile.*bin/probe"):
        forecast(far_records, client.get_run(far_id).data.metrics, steps, run_config(option),
                 profile_of(client, exp, ids))


def test_profile_round_trips_and_is_found_by_key(store, tmp_path) -> None:
    client, exp, ids = store
    profile = profile_of(client, exp, ids)
    path = save_profile(profile, tmp_path)
    again = StepCostProfile.from_json(json.loads(path.read_text()))
    assert again.to_json() == profile.to_json()
    found, note = find_profile(profile.key, tmp_path)
    assert found.to_json() == profile.to_json() and path.name in note
    other = type(profile.key)("vllm", "0.32.0", "tiny", "loop", "x")
    with pytest.raises(ProfileMissing, match="vllm-0.32.0-tiny-loop"):
        find_profile(other, tmp_path)


def test_forecast_from_the_baseline_lands_on_the_schedule(store) -> None:
    """The baseline's records + 2 tokens per step + the profile fitted without the option's own run: the
    forecast is the schedule's e2e ratio, and the measured option run (2 tokens per event) agrees within 10 %."""
    client, exp, ids = store
    base = client.get_run(ids["base"])
    records = run_records(client, ids["base"])
    for name in ("ngram4", "eagle3"):
        option = client.get_run(ids[name])
        profile = profile_of(client, exp, ids, exclude=(ids[name],))
        steps = [RequestSteps(len(r["output_token_ids"]) - 1, (len(r["output_token_ids"]) - 1) / 2, 1.0)
                 for r in finished(records)]
        result = forecast(records, base.data.metrics, steps, run_config(option), profile)
        for f in result.overall():
            measured = option.data.metrics[f"output_tok_s_c{f.concurrency}"] / base.data.metrics[
                f"output_tok_s_c{f.concurrency}"]
            assert f.speedup == pytest.approx(measured, rel=0.1), (name, f)
            assert f.low <= f.speedup <= f.high
            assert f.regime == ("graphs" if f.concurrency <= CAP else "eager")


def test_forecast_refuses_without_the_terms_it_needs(store) -> None:
    client, exp, ids = store
    records = run_records(client, ids["base"])
    base = client.get_run(ids["base"])
    only_ngram = profile_of(client, exp, ids, exclude=(ids["eagle1"], ids["eagle3"]))
    steps = [RequestSteps(len(r["output_token_ids"]) - 1, 10.0, 1.0) for r in finished(records)]
    with pytest.raises(ForecastUnavailable, match="draft_ms"):
        forecast(records, base.data.metrics, steps, run_config(client.get_run(ids["eagle3"])), only_ngram)
    with pytest.raises(ForecastUnavailable, match="offline estimates"):
        forecast(records, base.data.metrics, steps[:-1], run_config(client.get_run(ids["ngram4"])), only_ngram)
