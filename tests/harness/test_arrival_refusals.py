"""Open-loop settings that cannot run as given are refused before anything starts, naming the key and the fix; the
pairing identity keeps an open-loop run from ever pairing with a closed-loop baseline or one at another rate."""
from __future__ import annotations

import os
import resource
import time

import pytest
from conftest import compose_cfg, run_workspace

from experiments.config.views import ConfigError, typed_run, views_of
from experiments.harness.baseline import pair_key

OPEN = ("workload.arrival=poisson", "workload.rate=2", "workload.concurrency=4")


@pytest.mark.parametrize(("overrides", "words"), [
    (["workload.arrival=uniform"], "workload.arrival must be closed, poisson or gamma, got 'uniform'"),
    (["workload.arrival=poisson", "workload.concurrency=4"], "workload.arrival=poisson needs workload.rate"),
    (["workload.arrival=gamma", "workload.rate=0", "workload.concurrency=4"], "a finite number of requests/s > 0"),
    (["workload.arrival=gamma", "workload.rate=inf", "workload.concurrency=4"], "an unlimited rate is the closed loop"),
    (["workload.rate=2"], "open-loop settings given (workload.rate=2) while workload.arrival is closed"),
    (["workload.burstiness=0.5", "workload.arrival_seed=1"],
     "open-loop settings given (workload.arrival_seed=1, workload.burstiness=0.5) while workload.arrival is closed"),
    (["workload.arrival=poisson", "workload.rate=2"], "takes one concurrency cap (at most that many requests in "
                                                      "flight, as vllm bench serve --max-concurrency), got "
                                                      "workload.concurrency=[1, 4]"),
    ([*OPEN, "workload.burstiness=2"], "workload.arrival=poisson has burstiness 1, got workload.burstiness=2.0: "
                                       "use workload.arrival=gamma"),
    (["workload.arrival=gamma", "workload.rate=2", "workload.concurrency=4", "workload.burstiness=0"],
     "workload.burstiness must be > 0"),
    ([*OPEN, "workload.arrival_seed=-1"], "workload.arrival_seed must be within [0, 2**32)"),
    ([*OPEN, "workload.seed=-2"], "workload.seed must be within [0, 2**32) to seed the arrivals"),
])
def test_open_loop_settings_that_cannot_run_are_refused_naming_the_key(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        views_of(compose_cfg("+option=A", *overrides))
    assert words in str(refused.value), str(refused.value)


@pytest.mark.parametrize("overrides", [
    [*OPEN], ["workload.arrival=gamma", "workload.rate=0.5", "workload.burstiness=0.25", "workload.concurrency=[2]"],
    ["workload.arrival=gamma", "workload.rate=3", "workload.burstiness=inf", "workload.concurrency=1"],
    [*OPEN, "workload=multiturn"],   # multi-turn: a conversation arrives; its later turns follow its answers
])
def test_open_loop_settings_that_can_run_pass(overrides: list[str]) -> None:
    w = views_of(compose_cfg("+option=A", *overrides)).workload
    assert w.open_loop and len(w.concurrency) == 1


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_a_level_list_in_open_loop_is_refused_from_the_command_line_in_seconds(tmp_path) -> None:
    started, cpu = time.monotonic(), _children_cpu_s()
    out = run_workspace("+option=A", "workload=quick", "workload.arrival=poisson", "workload.rate=1",
                        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"hydra.run.dir={tmp_path / 'out'}",
                        env={"COLUMNS": "1000"}, timeout=60)
    elapsed, cpu = time.monotonic() - started, _children_cpu_s() - cpu
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "refused: workload.arrival=poisson takes one concurrency cap" in said, said[-2000:]
    assert "starting vllm" not in said and "Traceback" not in said
    assert cpu < 10 and elapsed < 60, f"refused after {elapsed:.1f} s ({cpu:.1f} s CPU, load {os.getloadavg()[0]:.1f})"


def _key(*overrides: str) -> str:
    return pair_key(typed_run(compose_cfg("+option=A", *overrides)), "0.32.0", "digest")


def test_open_loop_pairs_only_with_the_same_arrival_process() -> None:
    poisson = _key(*OPEN)
    assert poisson != _key("workload.concurrency=4")                                   # closed loop, same cap
    assert poisson != _key("workload.arrival=poisson", "workload.rate=1", "workload.concurrency=4")
    assert poisson != _key(*OPEN, "workload.arrival_seed=1")
    assert poisson != _key("workload.arrival=gamma", "workload.rate=2", "workload.burstiness=0.5",
                           "workload.concurrency=4")
    assert poisson != _key("workload.arrival=poisson", "workload.rate=2", "workload.concurrency=2")
    # the same process spelt another way is the same schedule
    assert poisson == _key("workload.arrival=gamma", "workload.rate=2", "workload.concurrency=4")
    assert poisson == _key(*OPEN, "workload.arrival_seed=0")                            # seed 0 is the default
    assert poisson == _key(*OPEN, "workload.request_timeout_s=5")                       # not what is measured


def test_the_baseline_overlay_keeps_the_options_arrival_process() -> None:
    """A fresh baseline is this config with conf/option/baseline.yaml laid over it: same key, same schedules."""
    from experiments.config.overlays import with_option

    cfg = compose_cfg("+option=A", *OPEN)
    assert pair_key(typed_run(with_option(cfg, "baseline")), "0.32.0", "d") == pair_key(typed_run(cfg), "0.32.0", "d")
