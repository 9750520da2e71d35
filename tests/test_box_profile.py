"""The Blackwell box profile: SGLang 0.5.23's and vLLM 0.32's own parsers over every option's command line,
a reason and an issue link for every flag, the Kimi drafter choice, and option D's SpecForge plan checked by
SpecForge's own config schema."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from conftest import VLLM_PYTHON, compose_cfg, run_workspace
from omegaconf.errors import InterpolationKeyError

from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter, model_config_present
from experiments.harness.launch import build_launch_spec
from experiments.harness.preflight import Refused, check_head_fits
from experiments.options.specforge_plan import SPECFORGE_TARGET, commands, draft_config, recipe, validate_recipe
from experiments.tracking.store import flatten
from sglang_patches import REGISTRY

ISSUE_LINK = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$")
DRAFTERS = ["lightseek_k25", "aq_medai_k25", "aq_medai_k2"]


def box(*overrides: str):
    return compose_cfg("site=blackwell", *overrides)


def flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


@pytest.fixture(scope="module")
def specforge_ready() -> None:
    if not (SPECFORGE_TARGET / "specforge" / "config" / "schema.py").exists():
        pytest.fail(f"SpecForge not installed at {SPECFORGE_TARGET}; run bin/setup")


@pytest.mark.parametrize("option", ["baseline", "A", "B", "E"])
def test_box_sglang_command_line_passes_sglang_parser(option: str) -> None:
    sglang = pytest.importorskip("sglang")
    spec = build_launch_spec(box(f"+option={option}", "option.missing=null"))
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
    args = build_launch_spec(cfg).args
    assert args[args.index("--speculative-draft-model-path") + 1] == head.path
    assert [args[args.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                              "--speculative-num-draft-tokens")] == \
        [str(head.num_steps), str(head.topk), str(head.num_draft_tokens)]
    assert SGLangAdapter().validate(sys.executable, args).ok


def test_sglang_parser_refuses_a_box_flag_it_does_not_know() -> None:
    pytest.importorskip("sglang")
    args = build_launch_spec(box("+option=B")).args
    bad = [a.replace("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-decodez") for a in args]
    result = SGLangAdapter().validate(sys.executable, bad)
    assert not result.ok and "--cuda-graph-max-bs-decodez" in result.error


@pytest.mark.parametrize("option", ["B", "C", "E"])
def test_options_use_the_drafters_recommendation(option: str) -> None:
    cfg = box(f"+option={option}", "option.missing=null")
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
    assert set(site.patches) == set(site.reasons.patches) and set(site.patches) <= set(REGISTRY)
    for group in site.reasons.values():
        for name, why in group.items():
            assert len(why.reason) > 30, name
            assert ISSUE_LINK.match(why.link), (name, why.link)
    for name in set(site.reasons.env) - set(site.env):  # documented, deliberately unset
        assert site.reasons.env[name].reason.startswith("NOT set"), name


def test_reasons_are_logged_with_every_run_as_params() -> None:
    params = flatten(box("+option=A"))
    assert params["site.reasons.sglang.--attention-backend.link"] == \
        "https://github.com/sgl-project/sglang/issues/24633"
    assert all(re.fullmatch(r"[\w./ -]+", k) for k in params if k.startswith("site.reasons."))


def test_option_c_box_command_passes_vllm_parser(embedded_ready) -> None:
    cfg = box("+option=C")   # the option itself switches the box to vLLM
    spec = build_launch_spec(cfg)
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


def test_draft_config_fits_kimi(tmp_path: Path) -> None:
    cfg = box("+option=D")
    head = draft_config(cfg)
    assert head["architectures"] == ["LlamaForCausalLMEagle3"]
    assert head["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert (head["hidden_size"], head["vocab_size"], head["draft_vocab_size"]) == (7168, 163840, 32000)
    # The workspace's own pre-launch fit check accepts it against Kimi's dimensions and refuses a mismatch.
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps(head))
    (tmp_path / "kimi").mkdir()
    target = {"text_config": dict(cfg.model.arch)}
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(target))
    check_head_fits(tmp_path / "head", tmp_path / "kimi")
    target["text_config"]["vocab_size"] = 129280   # a DeepSeek-V3 target
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(target))
    with pytest.raises(Refused, match="vocabulary 163840"):
        check_head_fits(tmp_path / "head", tmp_path / "kimi")


def test_specforge_schema_accepts_the_recipe_and_refuses_a_broken_one(tmp_path: Path, specforge_ready) -> None:
    cfg = box("+option=D")
    good = recipe(cfg, tmp_path)
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    ok, verdict = validate_recipe(tmp_path / "good.yaml")
    assert ok, verdict
    assert verdict.split() == ["offline", "local_colocated", "mlflow"]
    broken = {**good, "training": {**good["training"], "ttt_steps": 3}}   # SpecForge calls it ttt_length
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    ok, verdict = validate_recipe(tmp_path / "broken.yaml")
    assert not ok and "ttt_steps" in verdict


def test_specforge_commands_serve_the_target_with_the_site_flags(tmp_path: Path) -> None:
    cfg = box("+option=D")
    steps = commands(cfg, tmp_path)
    serve = next(s for s in steps if "--served-model-name" in s)   # through the sglang_patches launcher
    assert "--tp-size 8" in serve and "--speculative-algorithm" not in serve
    assert "SPECWS_SGLANG_PATCHES=sm12x_wna16_moe_triton" in serve
    capture = next(s for s in steps if "prepare_hidden_states.py" in s)
    assert "--tp-size 8" in capture and "--chat-template kimi-k2-instruct" in capture
    assert any(s.startswith("specforge export --to sglang") for s in steps)


def test_option_d_on_the_box_logs_a_d_plan_run(tmp_path: Path, specforge_ready) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_workspace("+option=D", "site=blackwell", f"tracking.uri={uri}",
                         f"tracking.artifact_root={tmp_path / 'artifacts'}",
                         f"train.specforge.work_dir={tmp_path / 'work'}", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kimi_k25_int4@blackwell")
    (run,) = client.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'D-plan'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["specws.specforge_check"] == "offline local_colocated mlflow"
    names = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "specforge")}
    assert names == {"draft_config.json", "recipe.yaml", "commands.sh"}
    logged = yaml.safe_load((tmp_path / "work" / "recipe.yaml").read_text())
    assert logged["tracking"] == {"report_to": "mlflow", "mlflow_tracking_uri": uri,
                                  "mlflow_experiment_name": "kimi_k25_int4@blackwell",
                                  "mlflow_run_name": "D-specforge-kimi_k25_int4"}
