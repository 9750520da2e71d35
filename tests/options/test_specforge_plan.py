"""Option D's SpecForge plan on the Blackwell box: the draft config against Kimi's dimensions, the recipe checked
by SpecForge's own config schema, the commands it writes, the hours estimate, and the D-plan run it logs (both
forms; their flag checks are in test_specforge_forms.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import compose_cfg, run_workspace

from experiments.harness.preflight import Refused, check_head_fits
from experiments.options.specforge_plan import (
    SPECFORGE_TARGET,
    commands,
    draft_config,
    draft_params,
    hours_estimate,
    recipe,
    validate_recipe,
)


def box(*overrides: str):
    return compose_cfg("site=blackwell", *overrides)


@pytest.fixture(scope="module")
def specforge_ready() -> None:
    if not (SPECFORGE_TARGET / "specforge" / "config" / "schema.py").exists():
        pytest.fail(f"SpecForge not installed at {SPECFORGE_TARGET}; run bin/setup")


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
    assert "sm12x_wna16_moe_triton" not in serve   # the box serves Marlin by default (docs/reference/sglang-patches.md)
    opted_in = commands(box("+option=D", "site.patches=[sm12x_wna16_moe_triton]"), tmp_path / "opt-in")
    assert any("SPECWS_SGLANG_PATCHES=sm12x_wna16_moe_triton" in s for s in opted_in if "--served-model-name" in s)
    capture = next(s for s in steps if "prepare_hidden_states.py" in s)
    assert "--tp-size 8" in capture and "--chat-template kimi-k2-instruct" in capture
    assert any(s.startswith("specforge export --to sglang") for s in steps)
    # the data recipe: ShareGPT and the team's own traffic (when its file is there), merged, answered by the target
    assert any("--data-path" in s and "traffic.jsonl" in s for s in steps if "prepare_data.py" in s)


def test_hours_estimate_states_its_formula_and_inputs() -> None:
    cfg = box("+option=D")
    head = draft_config(cfg)
    # fc 3h^2, q/k/v over 2h (Kimi's 64 heads of 112, 8 KV heads), o h^2, MLP 3 h x 40960, head h x 32000
    h, kv = 7168, 8 * 112
    assert draft_params(head) == 3 * h * h + 2 * h * (h + 2 * kv) + h * h + 3 * h * 40960 + h * 32000
    est = hours_estimate(cfg)
    assert est["kind"].startswith("estimate") and "regen_tok_s" in est["inputs"]
    assert est["inputs"]["bytes_per_token"] == 4 * 7168 * 2   # D.yaml's ~57 KB per token
    assert est["hours"]["total"] == pytest.approx(sum(v for k, v in est["hours"].items() if k != "total"), abs=0.06)
    faster = hours_estimate(box("+option=D", "train.specforge.estimate.regen_tok_s=2000"))
    assert faster["hours"]["regenerate"] == pytest.approx(est["hours"]["regenerate"] / 2, abs=0.01)


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
    assert run.data.tags["specws.specforge.current.check"].endswith(": ok")
    assert "last with train_eagle3.py" in run.data.tags["specws.specforge.v0.2.0-scripts.check"]
    assert run.data.tags["specws.specforge.draft"].startswith("LlamaForCausalLMEagle3")
    forms = {f: {Path(a.path).name for a in client.list_artifacts(run.info.run_id, f"specforge/{f}")}
             for f in ("current", "v0.2.0-scripts")}
    assert forms == {"current": {"draft_config.json", "recipe.yaml", "commands.sh"},
                     "v0.2.0-scripts": {"draft_config.json", "commands-scripts.sh"}}
    assert "estimate.json" in {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "specforge")}
    logged = yaml.safe_load((tmp_path / "work" / "recipe.yaml").read_text())
    assert logged["tracking"] == {"report_to": "mlflow", "mlflow_tracking_uri": uri,
                                  "mlflow_experiment_name": "kimi_k25_int4@blackwell",
                                  "mlflow_run_name": "D-specforge-kimi_k25_int4"}
