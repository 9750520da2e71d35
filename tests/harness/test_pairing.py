"""Baseline pairing: which stored baseline may stand in (key, host, age, no failed request), the sampled-output
check at temperature > 0, the near-tie margin under float32 rounding, and the refusal of unequal engine limits."""
from __future__ import annotations

import random
import time

import pytest
from mlflow.tracking import MlflowClient

from experiments.config.views import typed_run
from experiments.harness.baseline import compare_greedy, compare_sampled, find_baseline


def _baseline(client: MlflowClient, exp: str, key: str, host: str, errors: float, age_h: float = 0.0) -> str:
    start = int((time.time() - age_h * 3600) * 1000)
    run = client.create_run(exp, start_time=start, tags={"specws.option": "baseline", "specws.pair_key": key,
                                                         "specws.mode": "measure", "specws.host": host})
    client.log_metric(run.info.run_id, "errors", errors)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_stored_baseline_reused_only_on_same_key_host_recent_and_clean(store: str) -> None:
    client = MlflowClient(store)
    exp = client.create_experiment("pairing")
    _baseline(client, exp, "k1", "here", errors=2.0)              # failed requests: never reused
    _baseline(client, exp, "k1", "elsewhere", errors=0.0)         # another host
    _baseline(client, exp, "k1", "here", errors=0.0, age_h=30)    # too old for the drift check
    _baseline(client, exp, "k2", "here", errors=0.0)              # another workload / engine
    assert find_baseline(client, exp, "k1", "here", max_age_h=12) is None
    good = _baseline(client, exp, "k1", "here", errors=0.0, age_h=1)
    assert find_baseline(client, exp, "k1", "here", max_age_h=12).info.run_id == good


def _records(seed: int, n: int, vocab: int, length: tuple[int, int]) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_id": f"p{i}", "error": None,
             "output_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(*length))]} for i in range(n)]


def test_sampled_check_tells_same_distribution_from_another() -> None:
    base = _records(0, 60, 50, (20, 40))
    same, _ = compare_sampled(_records(1, 60, 50, (20, 40)), base)
    other, _ = compare_sampled(_records(2, 60, 10, (5, 10)), base)   # shorter, from a narrower vocabulary
    assert same["sampled_length_ks_p"] > 0.01 and other["sampled_length_ks_p"] < 1e-6
    assert same["sampled_token_tv"] < 2 * same["sampled_token_tv_noise"] + 0.05
    assert other["sampled_token_tv"] > 0.5


@pytest.mark.parametrize(("gap", "kind"), [(0.25000006, "near_tie"), (0.375, "divergence")])
def test_near_tie_margin_allows_float32_rounding(gap: float, kind: str) -> None:
    base = [{"prompt_id": "p", "turn": 0, "concurrency": 1, "repetition": 0, "error": None,
             "prompt_token_ids": [1, 2], "output_token_ids": [5, 6, 7]}]
    option = [{**base[0], "output_token_ids": [5, 9, 7]}]
    _, rows = compare_greedy(option, base, lambda ids: [(6, -1.0), (9, -1.0 - gap)], margin=0.25)
    assert rows[0]["kind"] == kind and rows[0]["first_divergence"] == 1


def test_the_pairing_key_covers_what_changes_the_engine_not_its_speculation() -> None:
    from conftest import compose_cfg

    from experiments.harness.baseline import pair_key

    def key(*overrides: str) -> str:
        return pair_key(typed_run(compose_cfg("+option=A", "site=local", *overrides)), "0.32.0", "prompts")

    plain = key()
    assert key("engine.env.VLLM_CPU_KVCACHE_SPACE=1") != plain
    assert key("engine.module=vllm.entrypoints.cli.main") != plain
    assert key("engine.python=/opt/other/python") != plain
    assert key("spec.num_draft_tokens=2") == plain            # the speculative flags are what is compared
    assert key("+engine.env.HF_TOKEN=a") == key("+engine.env.HF_TOKEN=b")   # a secret counts by name only
    assert key("workload.slo.ttft_p99_s=2.0") == plain         # targets judge both runs' records afterwards
    assert key("workload.max_tokens=32") != plain
    assert pair_key(typed_run(compose_cfg("+option=A", "site=local")), "0.32.1", "prompts") != plain
