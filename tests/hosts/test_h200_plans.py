"""bin/ holds recipes only: bin/h200's stages and the plan recipes call experiments.plans, valid bash, no step
runner; the plans bin/h200 starts itself (measure, standard, pairs) compose on site h200 as they pass their
overrides; a bad knob is refused by `bin/h200 <stage>` before anything is copied or started."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.config.paths import ROOT
from experiments.plans.settings import KnobError
from tests.helpers.plans import RECIPES, clean_env, planned_steps

BIN = ROOT / "bin"


def composed(argv: list[str]):
    """The config of a step's first job (a swept value: its first)."""
    overrides = [re.sub(r"^(workload|spec\.num_draft_tokens)=([^,\[]+),.*", r"\1=\2", o)
                 for o in argv[3:] if o != "-m" and not o.startswith("hydra.")]
    return compose_cfg(*overrides, "site=h200")


@pytest.mark.parametrize("script", sorted(p.name for p in BIN.iterdir() if p.is_file()))
def test_bin_holds_recipes_and_no_step_runner(script: str) -> None:
    text = (BIN / script).read_text()
    assert subprocess.run(["bash", "-n", str(BIN / script)]).returncode == 0
    assert not re.search(r"^\s*(step|runner|multirun|gated|trainer)\s*\(\)", text, re.M), script
    assert "bash -c" not in text and "PLAN_DRY_RUN" not in text and "lib/plan.sh" not in text, script
    if script in RECIPES:
        assert f"-m experiments.plans {RECIPES[script]} \"$@\"" in text and len(text.splitlines()) <= 12, script
    assert not (BIN / "lib").exists()


def test_the_standard_plan_measures_baseline_a_and_b_at_three_levels(tmp_path: Path) -> None:
    steps = planned_steps("standard", tmp_path)
    assert list(steps) == ["measure-baseline", "measure-A", "measure-B"]
    assert "spec.num_draft_tokens=8,4,2" in steps["measure-A"]
    for name, argv in steps.items():
        cfg = composed(argv)
        assert list(cfg.workload.concurrency) == [1, 4, 8] and cfg.workload.name == "grounded", name
        assert f"hydra.sweep.dir={tmp_path}/sweeps/{name.removeprefix('measure-')}" in argv


def test_measure_takes_its_options_workloads_and_overrides(tmp_path: Path) -> None:
    steps = planned_steps("measure", tmp_path, "options=A", "workloads=chat", "--", "spec.num_draft_tokens=2")
    assert list(steps) == ["measure-A"] and steps["measure-A"][-1] == "spec.num_draft_tokens=2"
    assert composed(steps["measure-A"]).spec.num_draft_tokens == 2


def test_the_pairs_rounds_compose_and_the_idle_check_follows(tmp_path: Path) -> None:
    steps = planned_steps("pairs", tmp_path, "idle=true")
    assert list(steps) == ["round1-interleaved", "round2-sequential", "round3-interleaved", "idle-server"]
    cfg = composed(steps["round2-sequential"])
    assert cfg.baseline.timing == "sequential" and list(cfg.workload.concurrency) == [1, 8]
    assert cfg.workload.warmup_requests == 1 and cfg.workload.blocks == 4 and not cfg.baseline.lookup
    with pytest.raises(KnobError, match="rounds"):
        planned_steps("pairs", tmp_path, "rounds=interleaved paired")


@pytest.mark.parametrize("stage,args,refusal", [
    ("d", ["nope=1"], "unknown key 'nope'"),
    ("kimi", ["budget_s=soon"], "budget_s='soon': not a number"),
    ("load", ["site=h200"], "unknown key 'site'"),
])
def test_a_bad_knob_is_refused_before_anything_starts(tmp_path: Path, stage: str, args: list[str],
                                                      refusal: str) -> None:
    out = subprocess.run([str(BIN / "h200"), stage, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=clean_env(SPECWS_DEST=str(tmp_path)))
    assert out.returncode == 2 and refusal in out.stderr and "started" not in out.stdout, out.stdout + out.stderr
    assert not (tmp_path / "code").exists() and not (tmp_path / "plan.log").exists()
