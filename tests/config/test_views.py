"""Typed views of the composed config: types and ranges refused before anything starts, naming the key."""
from __future__ import annotations

import time

import pytest
from conftest import compose_cfg, run_workspace

from experiments.config.views import ConfigError, views_of


@pytest.mark.parametrize("override, words", [
    ("workload.max_tokens=0", "workload.max_tokens must be > 0"),
    ("workload.max_tokens=abc", "workload.max_tokens: Value 'abc'"),
    ("workload.temperature=-1", "workload.temperature must be >= 0"),
    ("workload.repetitions=0", "workload.repetitions must be > 0"),
    ("workload.concurrency=[0,2]", "workload.concurrency must be a list of levels >= 1"),
    ("spec.num_draft_tokens=0", "spec.num_draft_tokens must be > 0"),
    ("limits.max_running_requests=-3", "limits.max_running_requests must be > 0"),
])
def test_bad_values_are_refused_naming_the_key(override: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(")):
        views_of(compose_cfg("+option=A", override))


def test_views_carry_typed_values() -> None:
    views = views_of(compose_cfg("+option=A", "workload.concurrency=4", "workload.max_tokens=64"))
    assert views.workload.concurrency == [4] and views.workload.max_tokens == 64
    assert views.spec.method == "ngram" and views.spec.speculative and views.limits.max_running_requests == 4
    assert views.engine == "vllm" and views.site.name == "local"


def test_a_bad_max_tokens_is_refused_in_seconds_with_no_engine() -> None:
    start = time.monotonic()
    proc = run_workspace("+option=A", "workload.max_tokens=0", timeout=60)
    assert proc.returncode == 2 and "workload.max_tokens must be > 0" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 10
    assert "starting vllm" not in proc.stdout + proc.stderr
