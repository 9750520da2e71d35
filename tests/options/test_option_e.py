"""Option E through the ordinary runner: real Hydra composition of `+option=E site=h200
model=tiny_moe_dsv3`, the launcher command line and environment (moe_budget, B), the tags every run carries,
SGLang's own parser over it, a dry-run multirun over B, and the refusals on sites without SGLang."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg, run_workspace

from experiments.config.paths import ROOT
from experiments.config.views import typed_run
from experiments.engines.config import engine_tags
from experiments.harness.launch import build_launch_spec
from experiments.harness.preflight import Refused, check_option
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.store import run_tags

SMALL_MOE = ("+option=E", "site=h200", "model=tiny_moe_dsv3")


def test_e_on_h200_launches_sglang_ngram_through_the_patch_launcher_with_the_budget() -> None:
    cfg = compose_cfg(*SMALL_MOE)
    check_option(typed_run(cfg))                      # not refused
    spec = build_launch_spec(typed_run(cfg))
    assert (spec.engine, spec.module) == ("sglang", "sglang_patches.launch")
    args = spec.args
    assert args[args.index("--speculative-algorithm") + 1] == "NGRAM"   # no EAGLE-3 head for the small MoE
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "4"
    assert args[args.index("--model-path") + 1] == str(ROOT / ".cache/models/tiny-moe-dsv3")
    assert "--disable-cuda-graph" not in args                            # B is captured into the verify graph
    assert spec.env["SPECWS_SGLANG_PATCHES"] == "moe_budget" and spec.env["SPECWS_SITE"] == "h200"
    assert spec.env["SPECWS_MOE_EXPERT_BUDGET"] == "8"                   # the model's default B
    assert spec.env["PYTHONPATH"].split(":")[0] == str(ROOT)             # the launcher finds sglang_patches
    assert "SPECWS_EXPERT_TELEMETRY_DIR" not in spec.env
    assert spec.to_dict()["sglang_patches"] == ["moe_budget"]
    tags = run_tags(typed_run(cfg), "measure", engine_tags(typed_run(cfg), "0.5.14"))
    assert tags["sglang_patches.requested"] == "moe_budget"
    assert (tags["specws.moe_expert_budget"], tags["specws.moe_num_experts"], tags["specws.moe_unbudgeted"]) == \
        ("8", "32", "false")


def test_each_budget_is_its_own_server_and_b_equal_to_the_experts_is_unbudgeted() -> None:
    specs = {b: build_launch_spec(typed_run(compose_cfg(*SMALL_MOE, f"spec.moe_expert_budget={b}")))
             for b in (32, 16, 2)}
    assert {b: s.env["SPECWS_MOE_EXPERT_BUDGET"] for b, s in specs.items()} == {32: "32", 16: "16", 2: "2"}
    assert len({s.key for s in specs.values()}) == 3
    assert len({tuple(s.args) for s in specs.values()}) == 1               # only the budget differs
    full = compose_cfg(*SMALL_MOE, "spec.moe_expert_budget=32")
    assert specs[32].env["SPECWS_SGLANG_PATCHES"] == "moe_budget"        # applied, and a no-op (below)
    full_run = typed_run(full)
    assert run_tags(full_run, "measure", engine_tags(full_run, "0.5.14"))["specws.moe_unbudgeted"] == "true"


def test_budget_at_the_expert_count_returns_sglangs_top_k_unchanged() -> None:
    torch = pytest.importorskip("torch")
    from sglang_patches.moe_budget import budget_topk

    logits = torch.randn(10, 32)
    weights, ids = logits.sigmoid().topk(4, dim=-1)
    out_w, out_ids = budget_topk(weights, ids.int(), logits, 32)
    assert torch.equal(out_w, weights) and torch.equal(out_ids, ids.int())


def test_baseline_of_e_runs_without_the_budget_patch() -> None:
    from experiments.config.overlays import with_option

    spec = build_launch_spec(typed_run(with_option(compose_cfg(*SMALL_MOE), "baseline")))
    assert "--speculative-algorithm" not in spec.args
    assert spec.env["SPECWS_SGLANG_PATCHES"] == "" and "SPECWS_MOE_EXPERT_BUDGET" not in spec.env


def test_telemetry_adds_expert_telemetry_after_the_budget_and_needs_eager_graphs() -> None:
    with pytest.raises(Refused, match=r"engine.extra_args=\[--disable-cuda-graph\]"):
        check_option(typed_run(compose_cfg(*SMALL_MOE, "spec.moe_telemetry=true")))
    cfg = compose_cfg(*SMALL_MOE, "spec.moe_telemetry=true", "engine.extra_args=[--disable-cuda-graph]")
    check_option(typed_run(cfg))
    spec = build_launch_spec(typed_run(cfg))
    assert spec.env["SPECWS_SGLANG_PATCHES"] == "moe_budget,expert_telemetry"
    assert spec.env["SPECWS_EXPERT_TELEMETRY_DIR"].endswith("moe-telemetry/tiny_moe_dsv3-B8-k4")
    assert "--disable-cuda-graph" in spec.args


@pytest.mark.parametrize("override, words", [
    ("spec.moe_expert_budget=0", "spec.moe_expert_budget must be > 0"),
    ("engine.module=sglang.launch_server", "need engine.module=sglang_patches.launch"),
    ("option.patches=[moe_budgett]", "moe_budgett")])
def test_bad_budget_or_launcher_or_patch_is_refused(override: str, words: str) -> None:
    with pytest.raises(Refused, match=words):
        check_option(typed_run(compose_cfg(*SMALL_MOE, override)))


def test_local_site_refuses_naming_sglang_and_the_offline_path() -> None:
    with pytest.raises(Refused, match=r"needs sglang, which site local does not have .*experiments\.options\.budget"):
        check_option(typed_run(compose_cfg("+option=E", "model=tiny_moe_dsv3")))


def test_e_small_moe_command_lines_pass_sglang_0_5_23_parser() -> None:
    sglang = pytest.importorskip("sglang")
    from experiments.engines.sglang_engine import SGLangAdapter

    cfgs = [compose_cfg(*SMALL_MOE, f"spec.moe_expert_budget={b}") for b in (32, 2)]
    cfgs.append(compose_cfg(*SMALL_MOE, "spec.moe_telemetry=true", "engine.extra_args=[--disable-cuda-graph]"))
    results = SGLangAdapter().validate_many(sys.executable, [build_launch_spec(typed_run(c)).args for c in cfgs])
    assert all(r.ok and r.version == sglang.__version__ for r in results), [r.error for r in results]


def test_dry_run_multirun_over_b_goes_through_the_runner_and_logs_budget_and_patches(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    offline = tmp_path / "offline"
    out = run_workspace("-m", *SMALL_MOE, "spec.moe_expert_budget=32,4", "run.dry_run=true",
                        f"tracking.uri=offline://{offline}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                        timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    client = OfflineClient(offline)
    runs = [client.get_run(r) for r in client.run_ids()]
    children = {r.data.params["spec.moe_expert_budget"]: r for r in runs if r.data.tags.get("mlflow.parentRunId")}
    assert set(children) == {"32", "4"}
    for b, run in children.items():
        tags = run.data.tags
        assert tags["specws.option"] == "E" and tags["specws.spec_method"] == "ngram"
        assert tags["sglang_patches.requested"] == "moe_budget" and tags["specws.moe_expert_budget"] == b
        assert tags["specws.moe_unbudgeted"] == ("true" if b == "32" else "false")
        assert run.data.params["option.patches"] == "['moe_budget']"
        launch = json.loads((offline / run.info.run_id / "artifacts" / "launch_spec.json").read_text())
        assert launch["env"]["SPECWS_MOE_EXPERT_BUDGET"] == b and launch["sglang_patches"] == ["moe_budget"]
        assert launch["argv"][1:3] == ["-m", "sglang_patches.launch"]
