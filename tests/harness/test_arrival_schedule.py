"""The open-loop arrival schedule: seeded, ascending, ending at n / rate, with the gaps' spread of a gamma process of
shape `burstiness`, and the very times `vllm bench serve` (vLLM's own `get_request`, run in the vLLM venv) draws for
the same rate, burstiness and seed."""
from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap

import numpy as np
import pytest
from conftest import VLLM_PYTHON, compose_cfg
from scipy import stats

from experiments.config.views import views_of
from experiments.harness.arrivals import Arrivals, gamma_arrivals


def test_the_schedule_is_seeded_ascending_and_ends_at_n_over_rate() -> None:
    times = gamma_arrivals(50, 2.0, 1.0, 7)
    assert times == gamma_arrivals(50, 2.0, 1.0, 7)
    assert times != gamma_arrivals(50, 2.0, 1.0, 8)
    assert times[0] > 0 and all(b > a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] == pytest.approx(50 / 2.0, rel=1e-12)
    assert gamma_arrivals(0, 2.0, 1.0, 7) == []


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_the_gaps_spread_as_a_gamma_process_of_shape_burstiness(burstiness: float) -> None:
    """Gamma gaps of shape k have a coefficient of variation 1 / sqrt(k) (Poisson: 1), and, scaled to mean 1,
    follow gamma(k, 1 / k): a wrong shape or an exponential drawn for every shape fails both."""
    n, rate = 20_000, 3.0
    gaps = np.diff([0.0, *gamma_arrivals(n, rate, burstiness, 11)])
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)   # the schedule is scaled to end at n / rate
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    scaled = gaps / gaps.mean()
    assert stats.kstest(scaled, "gamma", args=(burstiness, 0, 1 / burstiness)).pvalue > 0.01
    other = 1.0 if burstiness != 1.0 else 4.0
    assert stats.kstest(scaled, "gamma", args=(other, 0, 1 / other)).pvalue < 1e-6


def test_infinite_burstiness_gives_equal_gaps() -> None:
    assert np.allclose(np.diff([0.0, *gamma_arrivals(10, 4.0, math.inf, 0)]), 0.25)


def test_the_run_config_gives_the_process_and_seeds_each_repetition() -> None:
    w = views_of(compose_cfg("+option=A", "workload.arrival=gamma", "workload.rate=2", "workload.burstiness=0.5",
                             "workload.concurrency=4", "workload.seed=5")).workload
    arrivals = Arrivals.of(w)
    assert arrivals == Arrivals("gamma", 2.0, 0.5, 5)               # arrival_seed null: the workload's seed
    assert arrivals.schedule(8) == gamma_arrivals(8, 2.0, 0.5, 5)
    assert arrivals.schedule(8, repetition=1) == gamma_arrivals(8, 2.0, 0.5, 6)
    seeded = views_of(compose_cfg("+option=A", "workload.arrival=poisson", "workload.rate=2",
                                  "workload.concurrency=4", "workload.arrival_seed=9")).workload
    assert Arrivals.of(seeded).schedule(8) == gamma_arrivals(8, 2.0, 1.0, 9)
    assert Arrivals.of(views_of(compose_cfg("+option=A")).workload).schedule(8) is None   # closed loop


# vLLM's get_request, its clock stopped at 0 and its sleeps recorded instead of slept: each sleep is then exactly
# that request's arrival time (start + delay - now with start = now = 0); seeded as `vllm bench serve --seed` does
VLLM_DRAW = textwrap.dedent("""
    import asyncio, json, sys, types
    import numpy as np
    import vllm.benchmarks.serve as serve
    times = []
    async def sleep(s):
        times.append(s)
    serve.asyncio = types.SimpleNamespace(sleep=sleep)
    serve.time = types.SimpleNamespace(time=lambda: 0.0)
    async def draw(n, rate, burstiness, seed):
        times.clear()
        np.random.seed(seed)
        async for _ in serve.get_request(list(range(n)), rate, burstiness):
            pass
        return list(times)
    cases = json.loads(sys.argv[1])   # burstiness as a string: "inf" is no JSON number
    print(json.dumps([asyncio.run(draw(n, rate, float(b), seed)) for n, rate, b, seed in cases]))
""")
CASES = [(12, 1.0, 1.0, 0), (40, 2.5, 1.0, 3), (40, 2.5, 0.5, 3), (25, 0.7, 3.0, 123), (10, 4.0, math.inf, 0)]


def test_the_schedule_is_vllm_bench_serves_for_the_same_seed() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}; run bin/setup")
    cases = [[n, rate, str(b), seed] for n, rate, b, seed in CASES]
    out = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_DRAW, json.dumps(cases)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    for (n, rate, burstiness, seed), vllm_times in zip(CASES, theirs, strict=True):
        assert gamma_arrivals(n, rate, burstiness, seed) == pytest.approx(vllm_times, rel=1e-12, abs=1e-12), \
            (n, rate, burstiness, seed)
