"""python -m experiments.plans: a plan by name with its keys; an unknown key is refused before anything runs, a dry
run plans under $SPECWS_DEST and $OUT without touching them, --help lists the keys with their defaults, and a
real run writes each step's log, packs the store after a runner step and touches plan.done."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from experiments.config.paths import ROOT
from experiments.plans.catalog import PLANS
from experiments.plans.host import Host, multirun, runner
from experiments.plans.plan import Plan, run_plan
from experiments.plans.steps import Step


def plans(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECWS_DEST": str(tmp_path / "dest"), "OUT": str(tmp_path / "out")}
    return subprocess.run([sys.executable, "-m", "experiments.plans", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_an_unknown_key_is_refused_before_anything_runs(tmp_path: Path) -> None:
    out = plans(tmp_path, "d", "budget_s=1300", "D_MINUTES=6")
    assert out.returncode == 2 and "plans d: unknown key 'D_MINUTES'" in out.stderr and not out.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "dest").exists()
    assert plans(tmp_path, "nothing").returncode == 2


def test_a_dry_run_plans_and_writes_nothing(tmp_path: Path) -> None:
    out = plans(tmp_path, "d", "--dry-run", "minutes=6", "--", "run.dry_run=true")
    assert out.returncode == 0, out.stderr
    assert "== dry-run train: env -u PYTHONPATH python3 -m experiments.eagle3.gpu" in out.stdout
    assert "--minutes 6 " in out.stdout and "run.dry_run=true" in out.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "dest").exists()


def test_help_lists_each_key_with_its_default(tmp_path: Path) -> None:
    out = plans(tmp_path, "load", "--help")
    assert out.returncode == 0 and "  rates=8,32\n" in out.stdout and "  budget_s=1300\n" in out.stdout, out.stdout
    assert set(PLANS) == {"kimi", "tp8", "load", "d", "probe", "measure", "standard", "pairs"}


def test_a_real_run_logs_each_step_packs_the_store_and_marks_done(tmp_path: Path) -> None:
    host = Host(tmp_path / "dest", tmp_path / "out")
    (host.dest / "runs").mkdir(parents=True)
    (host.dest / "runs" / "meta.yaml").write_text("x\n")

    def items(settings, host: Host, run):
        hydra = host.dest / "hydra" / "one"
        hydra.mkdir(parents=True)
        (hydra / "server-1.log").write_text("served\n")
        step = runner(host, host.out / "t", "one", ("a=1",), "b=2")
        assert step.argv == ("python3", "-m", "experiments.run", "a=1", "b=2", f"hydra.run.dir={hydra}")
        yield Step("one", ("sh", "-c", "echo 'wrote one'"), after=step.after)
        sweep = multirun(host, "two", ("a=1",), "b=2")
        assert sweep.argv[3:] == ("-m", "a=1", "b=2", f"hydra.sweep.dir={host.dest}/sweeps/two")

    plan = Plan("t", object, items, logs="t", env=lambda s, h: None)
    console = io.StringIO()
    assert run_plan(plan, object(), host, console=console) == 0
    assert (host.out / "t" / "one.log").read_text() == "wrote one\n" and "\nwrote one\n" in console.getvalue()
    assert (host.out / "t" / "server-1.log").is_file() and (host.dest / "plan.done").is_file()
    with tarfile.open(host.out / "runs.tar.gz") as tar:
        assert tar.getnames() == ["runs", "runs/meta.yaml"]
