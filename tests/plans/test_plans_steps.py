"""The step runner: the budget stops later steps, a dry run plans without running, a step's exit status and its
lines of interest are reported, a gate skips a step when too little budget is left, a timeout ends the step's whole
process group, and a shared log shows each step only its own lines."""
from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

from experiments.plans.steps import TIMED_OUT, Action, Runner, Step


class Clock:
    """A clock the test moves by hand."""
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def runner(tmp_path: Path, budget_s: float | None = 60, **kw) -> Runner:
    return Runner(budget_s, tmp_path, console=io.StringIO(), **kw)


def sh(name: str, script: str, **kw) -> Step:
    return Step(name, ("sh", "-c", script), **kw)


def test_a_step_reports_its_exit_status_and_its_lines_of_interest(tmp_path: Path) -> None:
    run = runner(tmp_path)
    rc = run.run([sh("fails", "echo noise; echo 'error: gone'; exit 3"), sh("works", "true")])
    out = run.console.getvalue()
    assert rc == 1 and run.status == {"fails": 3, "works": 0} and run.failed == ["fails"]
    assert " fails rc=3 (" in out and "\nerror: gone\n" in out and "noise" not in out and " works rc=0 " in out, out
    assert (tmp_path / "fails.log").read_text() == "noise\nerror: gone\n"


def test_a_step_that_is_not_required_leaves_the_exit_status(tmp_path: Path) -> None:
    assert runner(tmp_path).run([sh("fit", "exit 1", required=False)]) == 0


def test_no_step_starts_once_the_budget_is_spent(tmp_path: Path) -> None:
    clock = Clock()
    run = runner(tmp_path, budget_s=60, clock=clock)
    packed = []

    def steps():
        yield sh("first", "true", after=lambda: packed.append("first"))
        clock.now += 61
        yield sh("second", "touch second", after=lambda: packed.append("second"))

    run.run(steps())
    assert list(run.status) == ["first"] and not (Path.cwd() / "second").exists()
    assert "== second: skipped, 61s of 60s spent" in run.console.getvalue()
    assert packed == ["first", "second"]        # the store is packed after a skipped runner step too


def test_a_gated_step_runs_only_while_enough_budget_is_left(tmp_path: Path) -> None:
    clock = Clock()
    run = runner(tmp_path, budget_s=300, clock=clock)
    clock.now += 100
    run.run([sh("t07", "true", need_s=210), sh("cheap", "true", need_s=200)])
    assert list(run.status) == ["cheap"]
    assert "== t07: skipped, 200s of the budget left (needs 210)" in run.console.getvalue()


def test_a_dry_run_plans_every_step_and_runs_nothing(tmp_path: Path) -> None:
    done = []
    run = runner(tmp_path, dry_run=True)
    marker = tmp_path / "ran"
    rc = run.run([sh("one", f"touch {marker}", need_s=10**6, after=lambda: done.append(1)),
                  Action(lambda: done.append(2)), Step("two", ("echo", "a b"))])
    assert rc == 0 and not marker.exists() and not done and not run.status
    assert run.planned == {"one": ("sh", "-c", f"touch {marker}"), "two": ("echo", "a b")}
    assert "== dry-run two: echo 'a b'\n" in run.console.getvalue()


def test_a_timeout_ends_the_steps_whole_process_group(tmp_path: Path) -> None:
    """The step starts a child that ignores nothing and outlives its parent's exit: both are gone after the
    timeout, and the step reports the timeout's status."""
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! > {pids}; echo $$ >> {pids}; wait"
    run = runner(tmp_path)
    start = time.monotonic()
    rc = run.step(sh("train", script, timeout_s=1.5))
    assert rc == TIMED_OUT and time.monotonic() - start < 15
    for pid in map(int, pids.read_text().split()):
        assert gone_within(pid, 5.0), pid


def test_a_timed_step_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    from experiments.plans import steps
    script = "trap '' TERM; sleep 300 & wait; sleep 300"
    proc = steps.subprocess.Popen(["sh", "-c", script], start_new_session=True)
    assert steps.wait_or_end(proc, timeout_s=0.5, grace_s=0.5) == TIMED_OUT and proc.poll() is not None


def test_a_shared_log_shows_each_step_its_own_lines(tmp_path: Path) -> None:
    log = tmp_path / "measure.log"
    run = Runner(None, None, log_file=log, console=io.StringIO(), shows="MLflow run")
    run.run([sh("a", "echo 'MLflow run a'"), sh("b", "echo 'MLflow run b'")])
    out = run.console.getvalue()
    assert out.count("MLflow run a") == 1 and out.count("MLflow run b") == 1, out
    assert log.read_text() == "MLflow run a\nMLflow run b\n" and run.left() == sys.maxsize


def test_a_command_that_cannot_start_fails_its_step(tmp_path: Path) -> None:
    run = runner(tmp_path)
    assert run.step(Step("gone", ("/nonexistent/python3", "-V"))) == 127 and run.failed == ["gone"]


def gone_within(pid: int, seconds: float) -> bool:
    """The process ended (a signal is delivered at once, its end and reaping take a moment)."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"
