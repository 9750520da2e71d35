"""bin/kimi-plan: valid bash, every module it starts exists and parses its arguments, and every runner step's
command, as the plan passes it (bin/lib/plan.sh: COMMON, then the step's own overrides, which win), composes and
passes the runner's dry run (launch spec built, config logged to a real store) on the h200-kimi site, so that a
lease is not spent on a run refused at its start."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.config.paths import ROOT
from tests.helpers.plans import planned_steps as plan_steps

PLAN = ROOT / "bin" / "kimi-plan"


def plan_text() -> str:
    return PLAN.read_text()


def planned_steps(dest: Path, **env: str) -> dict[str, list[str]]:
    return plan_steps(PLAN, dest, ("KIMI_OVERRIDES", "PLAN_BUDGET_S", "KIMI_KERNELS"), **env)


def runner_steps(dest: Path, **env: str) -> dict[str, list[str]]:
    """The runner steps' overrides, as the plan passes them to experiments.run."""
    run = ["python3", "-m", "experiments.run"]
    return {name: argv[3:] for name, argv in planned_steps(dest, **env).items() if argv[:3] == run}


def test_plan_is_valid_bash() -> None:
    for script in (PLAN, ROOT / "bin" / "lib" / "plan.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


@pytest.mark.parametrize("module", sorted(set(re.findall(r"python3 -m ([\w.]+)", plan_text())) - {"experiments.run"}))
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_step_reports_its_commands_exit_status(tmp_path: Path) -> None:
    script = (f'source {ROOT / "bin" / "lib" / "plan.sh"}; K={tmp_path} BUDGET=60 START=$(date +%s); '
              'step fails bash -c "echo error: gone; exit 3"; step works true')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=True).stdout
    assert re.search(r"fails rc=3 .*\nerror: gone\n", out) and "works rc=0" in out, out


def test_a_steps_own_overrides_win_over_the_plans_common_ones(tmp_path: Path) -> None:
    steps = runner_steps(tmp_path, KIMI_OVERRIDES="workload.num_prompts=64")

    def composed(name: str):
        return compose_cfg(*[o for o in steps[name] if not o.startswith("hydra.")])

    mrr8 = composed("B-mrr8")
    assert mrr8.workload.num_prompts == 32 and list(mrr8.workload.concurrency) == [1]
    assert mrr8.limits.max_running_requests == 8 and not mrr8.baseline.pair
    base = composed("baseline")
    assert base.workload.num_prompts == 64 and list(base.workload.concurrency) == [1, 4, 16, 64]
    assert composed("A-k2").spec.num_draft_tokens == 2


def test_every_runner_step_passes_the_dry_run(tmp_path: Path, store: str) -> None:
    dest = tmp_path / "dest"
    steps = planned_steps(dest)
    subprocess.run([sys.executable, *steps["build"][1:]], cwd=ROOT, check=True, capture_output=True, timeout=120)
    runs = runner_steps(dest)
    assert {"baseline", "A", "B", "E"} <= set(runs) and runs["baseline"][-2] == "+option=baseline"
    for name, overrides in runs.items():
        overrides = [f"tracking.uri={store}" if o.startswith("tracking.uri=") else o for o in overrides]
        argv = [sys.executable, "-m", "experiments.run", *overrides, "run.dry_run=true",
                f"hydra.run.dir={tmp_path / f'h-{name}'}"]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, (name, out.stdout[-1500:] + out.stderr[-3000:])
