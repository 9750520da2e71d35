"""The h200-kimi site: composed from the box profile (conf/site/blackwell.yaml) and the h200 host's facts, its command
lines accepted by SGLang 0.5.14's own parser for every SGLang option, every flag explained."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import compose_cfg
from omegaconf import open_dict
from omegaconf.errors import InterpolationResolutionError

from experiments.config.paths import cache_dir
from experiments.config.views import typed_run
from experiments.engines.sglang_engine import CHECK_SCRIPT, SGLangAdapter, draft_quantization_args
from experiments.harness.launch import build_launch_spec
from experiments.harness.preflight import Refused, check_head_loads, check_option
from experiments.tracking.store import flatten

SGLANG_0_5_14 = cache_dir() / "sglang-0.5.14"
OPTIONS = ["baseline", "A", "B", "E"]
SM90_DROPPED = {"--tp-size"}


def site(*overrides: str):
    return compose_cfg("site=h200-kimi", *overrides)


def flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def test_every_option_passes_sglang_0_5_14s_parser(monkeypatch) -> None:
    pytest.importorskip("sglang")
    if not (SGLANG_0_5_14 / "sglang-0.5.14.dist-info").is_dir():
        pytest.fail(f"SGLang 0.5.14 overlay missing ({SGLANG_0_5_14}); run bin/setup")
    monkeypatch.setenv("PYTHONPATH", str(SGLANG_0_5_14))
    specs = [build_launch_spec(typed_run(site(f"+option={o}"))) for o in OPTIONS]
    results = SGLangAdapter().validate_many(sys.executable, [s.args for s in specs])
    for option, spec, result in zip(OPTIONS, specs, results, strict=True):
        assert result.ok, f"+option={option} refused by SGLang {result.version}: {result.error}"
        assert result.version == "0.5.14"
        args = spec.args
        assert args[args.index("--load-format") + 1] == "dummy" and "--tp-size" not in args
    refused = SGLangAdapter().validate_many(sys.executable, [specs[0].args + ["--load-formatz", "dummy"]])[0]
    assert not refused.ok and "--load-formatz" in refused.error


def test_site_picks_the_miniature_and_sglang() -> None:
    cfg = site("+option=B")
    assert (cfg.model.name, cfg.engine.name, cfg.site.gpus) == ("kimi_k25_mini", "sglang", 1)
    assert list(cfg.site.patches) == []   # the SM 12.x kernel swap does not apply on sm_90
    assert cfg.spec.draft_model == f"{cfg.model.path}/eagle3"
    check_option(typed_run(cfg))
    e = site("+option=E")
    assert e.spec.method == "eagle3" and e.spec.moe_expert_budget == 64


def test_flags_are_the_box_profiles_minus_the_dropped_plus_the_changes() -> None:
    cfg = site("+option=baseline")
    box = list(cfg.profiles.box.site.engine_args.sglang)
    mine = list(cfg.site.engine_args.sglang)
    changes = cfg.site.flag_changes.sglang
    assert set(changes.drop) == SM90_DROPPED
    assert set(flags(box)) - set(flags(mine)) == SM90_DROPPED
    for flag in set(flags(box)) - SM90_DROPPED - set(changes.set):   # kept: the box's own value
        assert mine[mine.index(flag):mine.index(flag) + 2] == box[box.index(flag):box.index(flag) + 2], flag
    assert mine[mine.index("--mem-fraction-static") + 1] == "0.80"
    h200 = list(cfg.profiles.h200.site.engine_args.sglang)
    for flag in ("--sampling-backend", "--grammar-backend"):   # the host's facts, taken from the h200 site
        assert mine[mine.index(flag) + 1] == h200[h200.index(flag) + 1]


def test_a_box_flag_reaches_the_site_unless_dropped() -> None:
    box = compose_cfg("site=blackwell", "+option=baseline").site.engine_args.sglang
    cfg = site("+option=baseline", f"profiles.box.site.engine_args.sglang=[{','.join([*box, '--enable-foo'])}]")
    assert "--enable-foo" in cfg.site.engine_args.sglang
    stale = site("+option=baseline")
    with open_dict(stale):
        stale.site.flag_changes.sglang.drop["--no-such-flag"] = {"reason": "a reason that is long enough"}
    with pytest.raises(InterpolationResolutionError, match="no such flag"):
        list(stale.site.engine_args.sglang)


def test_every_flag_and_variable_has_a_reason() -> None:
    cfg = site("+option=baseline")
    given = set(flags(list(cfg.site.engine_args.sglang)))
    explained = set(cfg.site.reasons.sglang)
    assert given == explained, f"unexplained {given - explained}, stale {explained - given}"
    for flag, why in cfg.site.reasons.sglang.items():
        assert len(why.reason) > 30, flag
    assert set(cfg.site.env) == set(cfg.site.reasons.env)
    assert {cfg.site.reasons.sglang[f].from_base for f in cfg.site.flag_changes.sglang.set} <= {"changed", "added"}


def test_env_is_the_box_profiles_and_the_h200_hosts() -> None:
    """site.env is written out (the launch spec does not resolve interpolations there): it must stay equal."""
    cfg = site("+option=baseline")
    box, h200 = cfg.profiles.box.site.env, cfg.profiles.h200.site.env
    assert dict(cfg.site.env) == {**{k: box[k] for k in ("SGLANG_ENABLE_JIT_DEEPGEMM", "SGL_ENABLE_JIT_DEEPGEMM")},
                                  "HF_HUB_OFFLINE": h200.HF_HUB_OFFLINE}
    assert build_launch_spec(typed_run(cfg)).env["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"


def test_params_resolve_and_name_the_profiles() -> None:
    params = flatten(site("+option=B"))
    assert params["site.name"] == "h200-kimi" and params["profiles.box.site.name"] == "blackwell"
    assert params["site.reasons.sglang.--load-format.from_base"] == "added"


def test_the_miniature_routes_through_the_synthetic_router_before_the_budget() -> None:
    spec = build_launch_spec(typed_run(site("+option=E")))
    assert spec.env["SPECWS_SGLANG_PATCHES"] == "synthetic_router,moe_budget"
    assert spec.env["SPECWS_ROUTER_SKEW"] == "0.25" and spec.env["SPECWS_MOE_EXPERT_BUDGET"] == "64"
    assert "SPECWS_ROUTER_SKEW" not in build_launch_spec(typed_run(site("+option=E", "model.moe.router_skew=null"))).env


def test_a_router_skew_on_real_weights_is_refused() -> None:
    from experiments.config.errors import Refused
    from experiments.harness.preflight import check_patches
    check_patches(typed_run(site("+option=B")))   # --load-format dummy: allowed
    with pytest.raises(Refused, match="only for a model served with random weights"):
        check_patches(typed_run(compose_cfg("site=h200", "model=kimi_k25_mini", "+option=B")))


def test_site_env_interpolations_reach_the_server_resolved() -> None:
    cfg = site("+option=baseline", "+site.env.SPECWS_PROBE=${site.name}")
    assert build_launch_spec(typed_run(cfg)).env["SPECWS_PROBE"] == "h200-kimi"


def test_the_bf16_head_beside_the_int4_target_is_loaded_unquantised(tmp_path) -> None:
    """SGLang gives the draft the target's --quantization unless told: the random Kimi head (no
    quantization_config) died at load on the H200 in CompressedTensorsConfig() until this flag."""
    pytest.importorskip("sglang")
    for option in ("B", "E"):
        args = build_launch_spec(typed_run(site(f"+option={option}"))).args
        assert args[args.index("--speculative-draft-model-quantization") + 1] == "unquant", option
    env = {**os.environ, "PYTHONPATH": str(SGLANG_0_5_14)}
    proc = subprocess.run([sys.executable, str(CHECK_SCRIPT), "--values", "speculative_draft_model_quantization"],
                          env=env, input=json.dumps([args]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)[0]["speculative_draft_model_quantization"] == "unquant"
    quantised = tmp_path / "head"
    quantised.mkdir()
    (quantised / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert draft_quantization_args(str(quantised)) == []
    assert draft_quantization_args("lightseekorg/kimi-k2.5-eagle3") == ["--speculative-draft-model-quantization",
                                                                        "unquant"]


def test_a_head_sglang_cannot_load_is_refused_before_launch(tmp_path) -> None:
    """The random Kimi head had no draft_vocab_size: SGLang's llama_eagle3 died at load on the H200 (B and E)."""
    model = tmp_path / "kimi"
    subprocess.run([sys.executable, "-m", "experiments.box.kimi_mini", "build", "--out", str(model)], check=True,
                   capture_output=True, timeout=120)
    cfg = site("+option=B", f"model.path={model}")
    engine = typed_run(cfg).engine
    check_head_loads(engine, model / "eagle3")   # the builder writes draft_vocab_size: null (the target's vocabulary)
    head = json.loads((model / "eagle3" / "config.json").read_text())
    del head["draft_vocab_size"]
    (model / "eagle3" / "config.json").write_text(json.dumps(head))
    with pytest.raises(Refused, match="draft_vocab_size"):
        check_head_loads(engine, model / "eagle3")


def test_the_token_pool_is_capped_alike_for_baseline_and_options() -> None:
    """Sized by the target's 4-layer MLA cell, the EAGLE-3 draft's pool asked for 202.8 GiB on the H200."""
    for option in ("baseline", "A", "B", "E"):
        args = build_launch_spec(typed_run(site(f"+option={option}"))).args
        assert args[args.index("--max-total-tokens") + 1] == "1000000", option
