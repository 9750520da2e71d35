"""The Blackwell box profile: SGLang 0.5.23's and vLLM 0.32's own parsers over every option's command line,
a reason and an issue link for every flag, and the Kimi drafter choice."""
from __future__ import annotations

import json
import re
import sys

import pytest
from conftest import VLLM_PYTHON, compose_cfg
from omegaconf.errors import InterpolationKeyError

from experiments.config.views import typed_run
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter, model_config_present
from experiments.harness.launch import build_launch_spec
from experiments.tracking.store import flatten
from sglang_patches import REGISTRY

ISSUE_LINK = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$")
DRAFTERS = ["lightseek_k25", "aq_medai_k25", "aq_medai_k2"]


def box(*overrides: str):
    return compose_cfg("site=blackwell", *overrides)


def flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


@pytest.mark.parametrize("option", ["baseline", "A", "B", "E"])
def test_box_sglang_command_line_passes_sglang_parser(option: str) -> None:
    sglang = pytest.importorskip("sglang")
    spec = build_launch_spec(typed_run(box(f"+option={option}")))
    result = SGLangAdapter().validate(sys.executable, spec.args)
    assert result.ok, result.error
    assert result.version == sglang.__version__
    args = spec.args
    assert args[args.index("--tp-size") + 1] == "8"
    assert args[args.index("--attention-backend") + 1] == "triton"
    assert "--disable-custom-all-reduce" in args


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_each_kimi_drafter_reaches_sglang_with_its_recommended_settings(drafter: str) -> None:
    pytest.importorskip("sglang")
    cfg = box("+option=B", f"model.drafter={drafter}")
    head = cfg.model.eagle3_drafters[drafter]
    args = build_launch_spec(typed_run(cfg)).args
    assert args[args.index("--speculative-draft-model-path") + 1] == head.path
    assert [args[args.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                              "--speculative-num-draft-tokens")] == \
        [str(head.num_steps), str(head.topk), str(head.num_draft_tokens)]
    assert SGLangAdapter().validate(sys.executable, args).ok


def test_sglang_parser_refuses_a_box_flag_it_does_not_know() -> None:
    pytest.importorskip("sglang")
    args = build_launch_spec(typed_run(box("+option=B"))).args
    bad = [a.replace("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-decodez") for a in args]
    result = SGLangAdapter().validate(sys.executable, bad)
    assert not result.ok and "--cuda-graph-max-bs-decodez" in result.error


@pytest.mark.parametrize("option", ["B", "C", "E"])
def test_options_use_the_drafters_recommendation(option: str) -> None:
    cfg = box(f"+option={option}")
    head = cfg.model.eagle3_drafters[cfg.model.drafter]
    assert (cfg.spec.num_steps, cfg.spec.topk, cfg.spec.num_draft_tokens) == \
        (head.num_steps, head.topk, head.num_draft_tokens)
    assert cfg.spec.draft_model == head.path


def test_unknown_drafter_is_refused_by_composition() -> None:
    cfg = box("+option=B", "model.drafter=deepseek_v3")
    with pytest.raises(InterpolationKeyError):
        _ = cfg.spec.draft_model


def test_every_site_flag_and_variable_has_a_reason_and_an_issue_link() -> None:
    site = box("+option=baseline").site
    for engine in ("sglang", "vllm"):
        given = set(flags(list(site.engine_args[engine])))
        explained = set(site.reasons[engine])
        assert given == explained, f"{engine}: unexplained {given - explained}, stale {explained - given}"
    assert set(site.env) <= set(site.reasons.env)
    assert set(site.patches) <= set(site.reasons.patches) <= set(REGISTRY)
    for group in site.reasons.values():
        for name, why in group.items():
            assert len(why.reason) > 30, name
            assert ISSUE_LINK.match(why.link), (name, why.link)
    for name in set(site.reasons.env) - set(site.env):  # documented, deliberately unset
        assert site.reasons.env[name].reason.startswith("NOT set"), name
    for name in set(site.reasons.patches) - set(site.patches):  # documented opt-in fallbacks
        assert site.reasons.patches[name].reason.startswith("NOT in the default"), name


def test_box_runs_sglangs_default_int4_moe_kernel_and_keeps_triton_as_opt_in() -> None:
    default = build_launch_spec(typed_run(box("+option=baseline")))
    assert box("+option=baseline").site.patches == []
    assert "SPECWS_SGLANG_PATCHES" not in default.env or default.env["SPECWS_SGLANG_PATCHES"] == ""
    opted = build_launch_spec(typed_run(box("+option=baseline", "site.patches=[sm12x_wna16_moe_triton]")))
    assert opted.env["SPECWS_SGLANG_PATCHES"] == "sm12x_wna16_moe_triton"


def test_reasons_are_logged_with_every_run_as_params() -> None:
    params = flatten(box("+option=A"))
    assert params["site.reasons.sglang.--attention-backend.link"] == \
        "https://github.com/sgl-project/sglang/issues/24633"
    assert all(re.fullmatch(r"[\w./ -]+", k) for k in params if k.startswith("site.reasons."))


def test_option_c_box_command_passes_vllm_parser(embedded_ready) -> None:
    cfg = box("+option=C")   # the option itself switches the box to vLLM
    spec = build_launch_spec(typed_run(cfg))
    assert spec.python == str(VLLM_PYTHON)
    args = spec.args
    conf = json.loads(args[args.index("--speculative-config") + 1])
    assert conf == {"method": "eagle3", "model": cfg.model.eagle3_drafters.lightseek_k25.path,
                    "num_speculative_tokens": 3}
    # vLLM's create_engine_config() reads Kimi-K2.5's config.json (remote code); without the folder, as in
    # CI, only vLLM's serve parser and its post-parse checks run. On the box the engine config runs too.
    assert not model_config_present(args)
    result = VLLMAdapter().validate(spec.python, args)
    assert result.ok, result.error
    refused = VLLMAdapter().validate(spec.python, [a.replace("--max-num-seqs", "--max-num-seqz") for a in args])
    assert not refused.ok and "--max-num-seqz" in refused.error
