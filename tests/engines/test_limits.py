"""Equal engine limits: every command line (baseline included) pins the site's deployment value (else the
workload's largest concurrency) as the engine's running-request limit, a level above it is refused, SGLang
0.5.23's and 0.5.14's parsers read it, vLLM's engine config resolves it, and the limits read back from a server
compare only on what both runs could set alike."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import compose_cfg

from experiments.config.paths import cache_dir
from experiments.config.views import ConfigError, typed_run, views_of
from experiments.engines import limits_mismatch
from experiments.engines.base import Validation
from experiments.engines.sglang_engine import CHECK_SCRIPT, SGLangAdapter, server_info_limits
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.launch import build_launch_spec
from experiments.harness.pipeline import validated_spec

SGLANG_CASES = [(site, option) for site in ("h200", "blackwell") for option in ("baseline", "A", "B", "E")] + \
    [("h200", "E model=tiny_moe_dsv3")]
SITE_LIMIT = {"h200": 64, "blackwell": 128}   # site.max_running_requests: each site's deployment value


def _spec(site: str, option: str, *more: str):
    name, *rest = option.split()
    return build_launch_spec(typed_run(compose_cfg(f"+option={name}", f"site={site}", *rest, *more)))


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("release", ["0.5.23", "0.5.14"])
def test_every_sglang_command_line_pins_max_running_requests(release: str) -> None:
    pytest.importorskip("sglang")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if release == "0.5.14":
        overlay = cache_dir() / "sglang-0.5.14"
        if not (overlay / "sglang-0.5.14.dist-info").is_dir():
            pytest.fail(f"SGLang 0.5.14 overlay missing ({overlay}); run bin/setup")
        env["PYTHONPATH"] = str(overlay)
    else:
        env.pop("PYTHONPATH", None)
    specs = [_spec(site, option, "workload.concurrency=[1,4,16]") for site, option in SGLANG_CASES]
    expected = [SITE_LIMIT[site] for site, _ in SGLANG_CASES]
    assert [int(_flag(s.args, "--max-running-requests")) for s in specs] == expected
    proc = subprocess.run([sys.executable, str(CHECK_SCRIPT), "--values", "max_running_requests"], env=env,
                          input=json.dumps([s.args for s in specs]), capture_output=True, text=True, timeout=300)
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [p["max_running_requests"] for p in parsed] == expected, proc.stderr[-2000:]


def test_baseline_and_option_share_the_site_limit_and_a_level_above_it_is_refused() -> None:
    base, opt = _spec("h200", "baseline"), _spec("h200", "A")
    assert _flag(base.args, "--max-running-requests") == _flag(opt.args, "--max-running-requests") == "64"
    chat = compose_cfg("+option=B", "site=blackwell", "workload.concurrency=[1,4,16,64,128]")
    assert _flag(build_launch_spec(typed_run(chat)).args, "--max-running-requests") == "128"
    local = compose_cfg("+option=A", "site=local", "workload.concurrency=[1,4,16]")   # no site value: the workload's
    assert _flag(build_launch_spec(typed_run(local)).args, "--max-num-seqs") == "16"
    with pytest.raises(ConfigError, match=r"level 256 is above the engine limit limits.max_running_requests=128"):
        views_of(compose_cfg("+option=B", "site=blackwell", "workload.concurrency=[1,256]"))


def test_a_limit_the_site_or_the_user_gives_is_left_to_them() -> None:
    box_c = _spec("blackwell", "C")  # the box's vLLM flags carry --max-num-seqs 128 with a reason
    assert _flag(box_c.args, "--max-num-seqs") == "128"
    given = _spec("h200", "A", "engine.extra_args=[--max-running-requests,8]")
    assert _flag(given.args, "--max-running-requests") == "8"
    assert "--max-running-requests" not in _spec("h200", "A", "limits.max_running_requests=null").args


@pytest.mark.parametrize("option", ["baseline", "A", "C"])
def test_vllm_engine_config_reports_the_pinned_max_num_seqs(option: str, embedded_ready) -> None:
    # the runner's own check, cached per command line: tests/engines/test_parsers.py checks option A's too
    spec, validation = validated_spec(typed_run(compose_cfg(f"+option={option}")))
    assert _flag(spec.args, "--max-num-seqs") == "4"    # grounded: concurrency [1, 4]
    assert validation.ok, validation.error
    limits = VLLMAdapter().effective_limits("http://127.0.0.1:9", validation)
    assert limits["max_num_seqs"] == 4 and limits["max_model_len"] == 2048
    assert limits["async_scheduling"] == "False"   # off on the CPU whatever the method (platforms/cpu.py)
    assert {"max_num_batched_tokens", "enable_chunked_prefill"} <= limits.keys()
    if option == "A":
        assert (limits["speculative_prompt_lookup_min"], limits["speculative_prompt_lookup_max"]) == (2, 4)


def test_server_info_limits_of_0_5_23_and_0_5_9_shapes() -> None:
    # 0.5.23 http_server.py server_info: resolved fields + scheduler info + internal_states (scheduler state)
    new = {"max_running_requests": 16, "max_total_num_tokens": 90000, "chunked_prefill_size": 8192,
           "context_length": 2048, "disable_overlap_schedule": False, "speculative_algorithm": "NGRAM",
           "cuda_graph_config": {"decode": {"max_bs": 32}, "prefill": {"max_bs": 2048}}, "speculative_eagle_topk": 10,
           "internal_states": [{"effective_max_running_requests_per_dp": 16,
                                "memory_usage": {"token_capacity": 90000}}], "version": "0.5.23"}
    assert server_info_limits(new) == {
        "max_running_requests": 16.0, "max_total_num_tokens": 90000.0, "chunked_prefill_size": 8192.0,
        "context_length": 2048.0, "disable_overlap_schedule": "False", "speculative_algorithm": "NGRAM",
        "speculative_eagle_topk": 10.0, "cuda_graph_max_bs": 32.0, "effective_max_running_requests": 16.0,
        "token_capacity": 90000.0}
    old = {"max_running_requests": 48, "cuda_graph_max_bs": 8, "speculative_algorithm": None}  # 0.5.9: flat flags
    assert server_info_limits(old) == {"max_running_requests": 48.0, "cuda_graph_max_bs": 8.0}


def test_sglang_effective_limits_of_a_server_that_does_not_answer() -> None:
    assert SGLangAdapter().effective_limits("http://127.0.0.1:9", Validation(True, "0.5.23")) == {}


def test_limits_mismatch_ignores_what_only_speculation_has_or_fixes_itself() -> None:
    base = {"max_running_requests": "16.0", "chunked_prefill_size": "8192", "disable_overlap_schedule": "False",
            "max_total_num_tokens": "90000"}
    opt = {"max_running_requests": 16, "chunked_prefill_size": 8192.0, "disable_overlap_schedule": "True",
           "max_total_num_tokens": 70000, "speculative_num_draft_tokens": 4}
    assert limits_mismatch(opt, base) == []
    assert limits_mismatch({**opt, "max_running_requests": 48}, base) == ["max_running_requests: 48 vs 16.0"]
    assert limits_mismatch({"max_num_seqs": 4}, {}) == []   # a baseline logged before limits were read back
    # the box captures a speculative run's graphs to 32 and its baseline's to 128 (conf/site/blackwell.yaml)
    assert limits_mismatch({**opt, "cuda_graph_max_bs": 32.0}, {**base, "cuda_graph_max_bs": "128.0"}) == []
