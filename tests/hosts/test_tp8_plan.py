"""bin/tp8-plan: valid bash, every module it starts exists and parses its arguments, the site it names composes,
and every runner step composes there as the plan passes it (bin/lib/plan.sh: COMMON, then the step's own)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.config.paths import ROOT
from tests.helpers.plans import planned_steps as plan_steps

PLAN = ROOT / "bin" / "tp8-plan"


def modules() -> list[str]:
    return sorted(set(re.findall(r"python3 -m ([\w.]+)", PLAN.read_text())))


def planned_steps(dest: Path, **env: str) -> dict[str, list[str]]:
    return plan_steps(PLAN, dest, ("TP8_OVERRIDES", "PLAN_BUDGET_S", "GPUS"), **env)


def test_plan_is_valid_bash() -> None:
    for script in (PLAN, ROOT / "bin" / "lib" / "plan.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


@pytest.mark.parametrize("module", [m for m in modules() if m != "experiments.run"])
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_plan_measures_the_options_on_the_tp8_site() -> None:
    text = PLAN.read_text()
    for option in ("baseline", "A", "B", "E"):
        assert f"+option={option}" in text
    assert "NCCL_NVLS_ENABLE=0" in text and "--tp 8" in text
    cfg = compose_cfg("site=h200x8-kimi", "+option=E", "model.hf_config.num_hidden_layers=61")
    assert cfg.model.arch.num_hidden_layers == 61 and cfg.site.gpus == 8


def test_every_runner_step_composes_on_the_tp8_site_with_its_own_overrides_last(tmp_path: Path) -> None:
    steps = planned_steps(tmp_path, TP8_OVERRIDES="workload.max_tokens=32")
    runs = {name: argv[3:] for name, argv in steps.items() if argv[:3] == ["python3", "-m", "experiments.run"]}
    assert set(runs) == {"baseline", "E", "B", "A"}
    for name, overrides in runs.items():
        assert overrides[0] == "site=h200x8-kimi" and overrides[-2] == f"+option={name}", overrides
        cfg = compose_cfg(*[o for o in overrides if not o.startswith("hydra.")])
        assert cfg.model.arch.num_hidden_layers == 61 and cfg.workload.num_prompts == 320
        assert cfg.workload.max_tokens == 32 and list(cfg.workload.concurrency) == [1, 4, 16, 64, 128]


def test_fewer_than_eight_gpus_run_only_the_all_reduce_benchmark(tmp_path: Path) -> None:
    steps = planned_steps(tmp_path, GPUS="4")
    assert set(steps) == {"allreduce", "allreduce-nvlink"} and steps["allreduce"][:2] == ["env", "NCCL_P2P_DISABLE=1"]
    assert "--gpus" in steps["allreduce-nvlink"] and "4" in steps["allreduce-nvlink"]
