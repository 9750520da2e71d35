"""bin/kimi-plan: valid bash, every module it starts exists and parses its arguments, and every runner step's
command composes and passes the runner's dry run (launch spec built, config logged to a real store) on the
h200-kimi site, so that a lease is not spent on a run refused at its start."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config.paths import ROOT

PLAN = ROOT / "bin" / "kimi-plan"


def plan_text() -> str:
    return PLAN.read_text()


def common_overrides(model: Path, store: str) -> list[str]:
    """The plan's COMMON array, with the host's paths replaced by this test's."""
    body = re.search(r"COMMON=\((.*?)\)\n", plan_text(), re.S).group(1)
    words = [w.strip('"') for w in body.split() if not w.startswith("${")]
    return [w.replace("$MODEL", str(model)).replace("offline://$DEST/runs", store) for w in words]


def runner_steps() -> list[list[str]]:
    lines = plan_text().replace("\\\n", " ").splitlines()
    return [shlex.split(line)[2:] for line in lines if line.startswith("runner ")]


def test_plan_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(PLAN)]).returncode == 0


@pytest.mark.parametrize("module", sorted(set(re.findall(r"python3 -m ([\w.]+)", plan_text())) - {"experiments.run"}))
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_runner_step_passes_the_dry_run(tmp_path: Path, store: str) -> None:
    model = tmp_path / "kimi"
    subprocess.run([sys.executable, "-m", "experiments.moe.kimi_mini", "build", "--out", str(model)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    steps = runner_steps()
    assert {s[0] for s in steps} >= {"+option=baseline", "+option=A", "+option=B", "+option=E"}
    for n, step in enumerate(steps):
        argv = [sys.executable, "-m", "experiments.run", *common_overrides(model, store), *step,
                "run.dry_run=true", f"hydra.run.dir={tmp_path / f'h{n}'}"]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, (step, out.stdout[-1500:] + out.stderr[-3000:])
