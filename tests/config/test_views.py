"""Typed views of the composed config: types and ranges refused before anything starts, naming the key."""
from __future__ import annotations

import math
import resource
import time

import pytest
from conftest import compose_cfg, run_workspace

from experiments.config.views import ConfigError, views_of
from experiments.harness.deadlines import RequestSettings, derived_level_deadline_s, slice_rounds


@pytest.mark.parametrize("override, words", [
    ("workload.max_tokens=0", "workload.max_tokens must be > 0"),
    ("workload.max_tokens=abc", "workload.max_tokens: Value 'abc'"),
    ("workload.temperature=-1", "workload.temperature must be >= 0"),
    ("workload.repetitions=0", "workload.repetitions must be > 0"),
    ("workload.concurrency=[0,2]", "workload.concurrency must be a list of levels >= 1"),
    ("spec.num_draft_tokens=0", "spec.num_draft_tokens must be > 0"),
    ("limits.max_running_requests=-3", "limits.max_running_requests must be > 0"),
    ("workload.level_timeout_s=0", "workload.level_timeout_s must be > 0, auto or null"),
    ("workload.level_timeout_s=-5", "workload.level_timeout_s must be > 0, auto or null"),
    ("workload.level_timeout_s=soon", "workload.level_timeout_s must be a number of seconds > 0, auto or null, "
                                      "got 'soon'"),
    ("workload.level_timeout_s=[1,2]", "workload.level_timeout_s must be a number of seconds"),
    ("workload.floor_tok_s=0", "workload.floor_tok_s must be > 0"),
    ("workload.floor_tok_s=abc", "workload.floor_tok_s: Value 'abc'"),
    ("server.url=localhost:8000", "server.url must be an http:// or https:// URL, got 'localhost:8000'"),
    ("baseline.url=ftp://x", "baseline.url must be an http:// or https:// URL"),
    ("baseline.loaded_host_share=0", "baseline.loaded_host_share must be > 0"),
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
    start, cpu = time.monotonic(), _children_cpu_s()
    proc = run_workspace("+option=A", "workload.max_tokens=0", timeout=60)
    assert proc.returncode == 2 and "workload.max_tokens must be > 0" in proc.stdout + proc.stderr
    # CPU time, not wall time: on a shared 2-core machine (CI's two workers) the wall time follows the load
    assert _children_cpu_s() - cpu < 10 and time.monotonic() - start < 60
    assert "starting vllm" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("override, value", [
    (None, "auto"), ("workload.level_timeout_s=900", 900.0), ("workload.level_timeout_s=2.5", 2.5),
    ("workload.level_timeout_s=null", None),
])
def test_level_timeout_is_seconds_auto_or_none(override: str | None, value) -> None:
    views = views_of(compose_cfg("+option=A", *([override] if override else [])))
    assert views.workload.level_timeout_s == value and type(views.workload.level_timeout_s) is type(value)


def test_the_floor_rate_default_is_the_clients_own() -> None:
    """measure.py builds RequestSettings without floor_tok_s: both defaults must be the same number."""
    assert views_of(compose_cfg("+option=A")).workload.floor_tok_s == RequestSettings(1, 0.0, 0, 1).floor_tok_s


def test_a_derived_level_deadline_is_rounds_times_the_slowest_request() -> None:
    per_request = 128 / 1.0 + 30.0
    assert slice_rounds([1] * 64, 1) == 64 and slice_rounds([1] * 64, 4) == 16 and slice_rounds([1] * 5, 4) == 2
    assert derived_level_deadline_s([1] * 64, 1, 128, 1.0, 120.0) == 64 * per_request
    assert derived_level_deadline_s([1] * 5, 4, 128, 1.0, 120.0) == 2 * per_request
    assert derived_level_deadline_s([1], 1, 8, 4.0, 120.0, ttft_allowance_s=1.0) == 120.0   # at least one stall
    assert derived_level_deadline_s([], 4, 128, 1.0, 120.0) == 120.0


def test_a_long_conversation_is_bounded_as_it_is_scheduled() -> None:
    """Two slots, three 2-turn conversations: the third starts after two turns, so four request times, not
    ceil(6 / 2) = 3; Graham's bound gives 6 / 2 + (1 - 1/2) x 2 = 4."""
    assert slice_rounds([2, 2, 2], 2) == 4.0
    assert slice_rounds([10, 1, 1, 1], 4) >= 10          # one long conversation finishes last
    assert math.isclose(slice_rounds([3, 1], 1), 4.0)    # one slot: every turn in a row


def test_the_client_settings_resolve_the_level_deadline() -> None:
    auto = RequestSettings(8, 0.0, 0, 60, 3.0, "auto", floor_tok_s=4.0, ttft_allowance_s=1.0)
    assert auto.level_deadline_s([1, 1, 1], 1) == 9.0 and auto.level_deadline_s([1], 1) == 3.0
    assert RequestSettings(8, 0.0, 0, 60, 3.0, 5).level_deadline_s([1] * 9, 1) == 5.0
    capped = RequestSettings(8, 0.0, 0, 60, 3.0, "auto", floor_tok_s=4.0, ttft_allowance_s=1.0, engine_slots=2)
    assert capped.level_deadline_s([1] * 8, 8) == 4 * 3.0 and capped.level_deadline_s([1] * 8, 1) == 8 * 3.0
    assert RequestSettings(8, 0.0, 0, 60, 3.0, None).level_deadline_s([1] * 9, 1) is None


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("overrides, label", [
    (["workload=grounded"], "grounded"),
    (["workload=grounded", "workload.prompt_set=code"], "grounded-code"),
    (["workload=grounded", "workload.prompt_set=math"], "grounded-math"),
    (["workload=file", "workload.prompt_set=/data/question.jsonl"], "file-question"),
    (["workload=quick"], "quick-grounded"),
    (["workload=mixed"], "mixed-chat+code+6more"),
])
def test_run_names_carry_the_prompt_set(overrides: list[str], label: str) -> None:
    """Code and math prompts under one workload were stored under one run name: the label names the set."""
    assert views_of(compose_cfg("+option=A", *overrides)).workload.label == label
