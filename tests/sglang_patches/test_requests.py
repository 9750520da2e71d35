"""The rules a launch's requested patches must meet, each refused by name before anything starts."""
from __future__ import annotations

import pytest

from sglang_patches import PatchRefused, UnknownPatch
from sglang_patches.requests import LAUNCHER, check_request, flag_is

DUMMY = ["--load-format", "dummy"]


def test_a_request_the_patches_can_serve_passes() -> None:
    check_request([], "sglang.launch_server", [], [], None)              # nothing asked: any entry module
    check_request(["synthetic_router", "moe_budget", "expert_telemetry"], LAUNCHER,
                  [*DUMMY, "--disable-cuda-graph"], ["moe_budget"], 64)


@pytest.mark.parametrize(("patches", "module", "args", "forced", "budget", "named"), [
    (["no_such_patch"], LAUNCHER, [], [], None, "unknown sglang_patches \\['no_such_patch'\\]"),
    (["moe_budget"], "sglang.launch_server", [], [], 8, "need engine.module=sglang_patches.launch"),
    (["synthetic_router"], LAUNCHER, [], [], None, "only for a model served with random weights"),
    (["moe_budget"], LAUNCHER, [], ["sm12x_wna16_moe_triton"], 8, "site.patches_forced \\['sm12x_wna16_moe_triton'\\]"),
    (["moe_budget"], LAUNCHER, [], [], 0, "spec.moe_expert_budget must be a positive integer, got 0"),
    (["moe_budget"], LAUNCHER, [], [], None, "spec.moe_expert_budget must be a positive integer, got None"),
    (["expert_telemetry"], LAUNCHER, [], [], None, "add 'engine.extra_args=\\[--disable-cuda-graph\\]'"),
])
def test_each_rule_is_refused_by_name(patches, module, args, forced, budget, named) -> None:
    with pytest.raises((PatchRefused, UnknownPatch), match=named):
        check_request(patches, module, args, forced, budget)


def test_a_flag_is_read_in_both_spellings() -> None:
    assert flag_is(DUMMY, "--load-format", "dummy") and flag_is(["--load-format=dummy"], "--load-format", "dummy")
    assert not flag_is(["--load-format", "auto"], "--load-format", "dummy")
    assert not flag_is(["--load-format"], "--load-format", "dummy")     # a flag without its value
