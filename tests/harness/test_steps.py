"""Server-side step times: SGLang's own clock from a real finishing meta_info, the chunk clock elsewhere, and the
flags for a step that does not hold still within a level."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.steps import bimodal, drifting, step_excess, step_metrics

# a B request's finishing meta_info as SGLang 0.5.14 sent it on the H200 (docs/journal/2026-12-04-h200, c = 64)
META = {"completion_tokens": 96, "spec_verify_ct": 41, "decode_throughput": 791.1029925994233,
        "spec_accept_length": 2.341463414634146}


def test_sglang_steps_come_from_its_own_decode_clock():
    step = SGLangAdapter().request_step_s({"meta": META})
    assert step == pytest.approx(95 / 791.1029925994233 / 41)             # 2.93 ms per verification
    plain = {k: META[k] for k in ("completion_tokens", "decode_throughput")}
    assert SGLangAdapter().request_step_s({"meta": plain}) == pytest.approx(1 / 791.1029925994233)
    assert SGLangAdapter().request_step_s({"meta": META, "error": "x"}) is None


def test_other_engines_time_steps_by_the_chunks():
    record = {"chunk_times_s": [0.10, 0.13, 0.16, 0.19], "chunk_tokens": [1, 2, 1, 3]}
    assert VLLMAdapter().request_step_s(record) == pytest.approx(0.03)
    assert VLLMAdapter().request_step_s({"chunk_times_s": [0.1, 0.2], "chunk_tokens": [1, 1]}) is None


def test_two_groups_of_steps_are_bimodal_and_a_tail_is_not():
    rng = np.random.default_rng(0)
    two = np.concatenate([rng.normal(3.1, 0.05, 30), rng.normal(4.7, 0.05, 30)])
    assert bimodal(two)
    tail = np.concatenate([rng.normal(3.0, 0.05, 55), [3.4, 3.8, 4.5, 5.2, 6.0]])
    assert not bimodal(tail)
    assert not bimodal(rng.normal(3.0, 0.1, 60))


def test_a_step_that_grows_through_the_level_drifts():
    rng = np.random.default_rng(1)
    assert drifting(np.linspace(2.0, 3.0, 40) + rng.normal(0, 0.05, 40))
    assert not drifting(rng.normal(2.5, 0.05, 40))


def test_level_metrics_and_the_excess_over_the_baseline():
    records = [{"start_s": float(i), "meta": {**META, "decode_throughput": 700.0 + (i % 2) * 200}}
               for i in range(20)]
    m = step_metrics(records, SGLangAdapter())
    assert m["step_requests"] == 20
    assert m["step_p10_ms"] < m["step_p50_ms"] < m["step_p90_ms"]
    assert step_excess({"step_p50_ms_c1": 3.0}, {"step_p50_ms_c1": 1.2}) == {
        "step_excess_ms_c1": pytest.approx(1.8), "step_ratio_c1": pytest.approx(2.5)}
