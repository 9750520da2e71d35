"""The kimi plan (experiments/plans/kimi.py, bin/kimi-plan): every module it starts exists and parses its arguments,
the recipe dry-runs it, and every runner step's command, as the plan passes it (the common overrides, then the
step's own, which win), composes and passes the runner's dry run (launch spec built, config logged to a real store)
on the h200-kimi site, so that a lease is not spent on a run refused at its start."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.config.paths import ROOT
from tests.helpers.plans import module_answers_help, planned_steps, recipe_dry_run, started_modules

RUN = ["python3", "-m", "experiments.run"]
DEST = Path("/tmp/specws")


def runner_steps(dest: Path, *args: str) -> dict[str, list[str]]:
    """The runner steps' overrides, as the plan passes them to experiments.run."""
    return {name: argv[3:] for name, argv in planned_steps("kimi", dest, *args).items() if argv[:3] == RUN}


@pytest.mark.parametrize("module", sorted(started_modules(planned_steps("kimi", DEST, "kernels=true"))
                                          - {"experiments.run"}))
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    module_answers_help(module)


def test_the_plans_steps_in_order(tmp_path: Path) -> None:
    steps = planned_steps("kimi", tmp_path)
    assert list(steps) == ["build", "graphs", "graphs-reverse", "baseline", "B", "E", "B-mrr8", "B-mrr64",
                           "selfcheck", "A", "A-k2", "A-k8", "telemetry-ngram", "telemetry-decode",
                           "baseline-triton"]
    assert list(planned_steps("kimi", tmp_path, "kernels=true"))[:2] == ["build", "kernels"]
    assert steps["baseline"][-1] == f"hydra.run.dir={tmp_path}/hydra/baseline"


def test_the_recipe_dry_runs_the_plan(tmp_path: Path) -> None:
    out = recipe_dry_run("kimi-plan", tmp_path, "budget_s=900", "--", "workload.max_tokens=32")
    assert "== plan kimi: budget_s=900.0 kernels=False overrides=workload.max_tokens=32" in out, out
    assert f"== dry-run B-mrr8: {' '.join(RUN)} site=h200-kimi" in out and not (tmp_path / "plan.done").exists()


def test_a_steps_own_overrides_win_over_the_plans_common_ones(tmp_path: Path) -> None:
    steps = runner_steps(tmp_path, "overrides=workload.num_prompts=64")

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
    steps = planned_steps("kimi", dest)
    subprocess.run([sys.executable, *steps["build"][1:]], cwd=ROOT, check=True, capture_output=True, timeout=120)
    runs = runner_steps(dest)
    assert {"baseline", "A", "B", "E"} <= set(runs) and runs["baseline"][-2] == "+option=baseline"
    for name, overrides in runs.items():
        overrides = [f"tracking.uri={store}" if o.startswith("tracking.uri=") else o for o in overrides]
        argv = [sys.executable, "-m", "experiments.run", *overrides, "run.dry_run=true",
                f"hydra.run.dir={tmp_path / f'h-{name}'}"]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, (name, out.stdout[-1500:] + out.stderr[-3000:])
