"""The h200x8-kimi site: the box's flags at TP 8 on eight H200s, all-reduce off NVLink, multicast off everywhere,
every flag and variable explained; a multi-GPU site without the multicast switches is refused."""
from __future__ import annotations

import sys

import pytest
from conftest import compose_cfg
from omegaconf import open_dict

from experiments.config.paths import cache_dir
from experiments.config.views import typed_run
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.harness.launch import build_launch_spec
from experiments.harness.preflight import MULTICAST_OFF_ENV, Refused, check_option

OPTIONS = ["baseline", "A", "B", "E"]


def site(*overrides: str):
    return compose_cfg("site=h200x8-kimi", *overrides)


def value_of(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_is_accepted_at_tp_8_with_the_box_flags(option: str) -> None:
    cfg = site(f"+option={option}")
    check_option(typed_run(cfg))
    args = build_launch_spec(typed_run(cfg)).args
    assert value_of(args, "--tp-size") == "8"
    assert "--disable-custom-all-reduce" in args
    assert value_of(args, "--mem-fraction-static") == "0.85"
    assert value_of(args, "--load-format") == "dummy"
    box = list(compose_cfg("site=blackwell", f"+option={option}").site.engine_args.sglang)
    kept = {a for a in box if a.startswith("--")} - {"--attention-backend", "--mem-fraction-static"}
    assert kept <= set(args), "a box flag was lost"


def test_all_reduce_is_forced_off_nvlink_but_not_off_shared_memory() -> None:
    env = dict(site("+option=baseline").site.env)
    assert env["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_SHM_DISABLE" not in env   # SHM through host memory is the PCIe-like path
    assert all(env[k] == v for k, v in MULTICAST_OFF_ENV.items())


def test_every_flag_and_variable_has_a_reason() -> None:
    cfg = site("+option=B")
    reasons = cfg.site.reasons
    for flag in (a for a in cfg.site.engine_args.sglang if a.startswith("--")):
        assert reasons.sglang[flag].reason, flag
    for var in cfg.site.env:
        assert reasons.env[var].reason, var
    for var in ("NCCL_P2P_DISABLE", *MULTICAST_OFF_ENV):
        assert str(reasons.env[var].link).startswith("https://"), var


@pytest.mark.parametrize("missing", sorted(MULTICAST_OFF_ENV))
def test_a_multi_gpu_site_without_a_multicast_switch_is_refused(missing: str) -> None:
    cfg = site("+option=baseline")
    with open_dict(cfg):
        del cfg.site.env[missing]
    with pytest.raises(Refused, match=missing):
        check_option(typed_run(cfg))


def test_a_site_that_says_it_has_no_nvlink_or_one_gpu_is_not_asked() -> None:
    cfg = site("+option=baseline")
    with open_dict(cfg):
        for var in MULTICAST_OFF_ENV:
            del cfg.site.env[var]
        cfg.site.nvlink = False
    check_option(typed_run(cfg))
    with open_dict(cfg):
        cfg.site.nvlink = True
        cfg.site.gpus = 1
    check_option(typed_run(cfg))


def test_every_option_passes_sglang_0_5_14s_parser(monkeypatch) -> None:
    pytest.importorskip("sglang")
    overlay = cache_dir() / "sglang-0.5.14"
    if not (overlay / "sglang-0.5.14.dist-info").is_dir():
        pytest.fail(f"SGLang 0.5.14 overlay missing ({overlay}); run bin/setup")
    monkeypatch.setenv("PYTHONPATH", str(overlay))
    specs = [build_launch_spec(typed_run(site(f"+option={o}"))) for o in OPTIONS]
    results = SGLangAdapter().validate_many(sys.executable, [s.args for s in specs])
    for option, result in zip(OPTIONS, results, strict=True):
        assert result.ok and result.version == "0.5.14", f"+option={option}: {result.error}"
