"""The step runner of the lease plans: each step is a command line run in turn, its output in a log of its own (or
on this console), its exit status and the lines of interest echoed after it. No step starts once the plan's time
budget is spent; a gated step starts only while enough of the budget is left; a step with a timeout is ended with
its whole process group (SGLang's engine processes too, so the GPU is free for what follows). A dry run prints each
step's command line, shell-quoted, instead of running it, and records it in `planned`."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

# the lines of a step's log echoed after it (a plan may add its own), and how many of them
STEP_SHOWS = "MLflow run|output_tok_s|refused|Refused|Error|error:|tok/s|wrote"
STEP_LINES = 12
KILL_GRACE_S = 20.0      # after the timeout's SIGTERM, SIGKILL (as `timeout -k 20`)
TIMED_OUT = 124          # the exit status `timeout` reports


@dataclass(frozen=True)
class Step:
    """One command of a plan. need_s: it starts only while that many seconds of the budget are left (a dry run
    prints it anyway); timeout_s: its process group is ended after that long; after: what follows it in a real
    run whether it ran or was skipped (the store packed, logs copied); required: a failure counts in the plan's
    exit status."""
    name: str
    argv: tuple[str, ...]
    need_s: float = 0.0
    timeout_s: float | None = None
    after: Callable[[], None] | None = None
    required: bool = True


@dataclass(frozen=True)
class Action:
    """Something a real run does between steps (a dry run leaves it out): files packed or copied."""
    do: Callable[[], None]


Item = Step | Action


@dataclass
class Runner:
    """Runs a plan's items in order. logs: the folder of one log per step; log_file: instead, one log every step
    appends to; neither: the steps' output on this console. env: the steps' environment (None: this process's)."""
    budget_s: float | None
    logs: Path | None
    dry_run: bool = False
    log_file: Path | None = None
    shows: str = STEP_SHOWS
    lines: int = STEP_LINES
    env: Mapping[str, str] | None = None
    console: TextIO = field(default_factory=lambda: sys.stdout)
    clock: Callable[[], float] = time.monotonic
    planned: dict[str, tuple[str, ...]] = field(default_factory=dict)
    status: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def spent(self) -> int:
        return int(self.clock() - self.start)

    def left(self) -> int:
        """Seconds of the budget left (a plan without a budget: always plenty)."""
        return sys.maxsize if self.budget_s is None else int(self.budget_s) - self.spent()

    def echo(self, text: str) -> None:
        print(text, file=self.console, flush=True)

    def run(self, items: Iterable[Item]) -> int:
        """Every item in turn; 0 when every required step that ran succeeded, else 1."""
        for item in items:
            if isinstance(item, Action):
                if not self.dry_run:
                    item.do()
                continue
            self.step(item)
            if item.after is not None and not self.dry_run:
                item.after()
        return 1 if self.failed else 0

    def step(self, step: Step) -> int | None:
        """Run one step unless the budget or its gate says no; its exit status, None when it did not run."""
        if self.budget_s is not None and self.spent() >= self.budget_s:
            self.echo(f"== {step.name}: skipped, {self.spent()}s of {int(self.budget_s)}s spent")
            return None
        if self.dry_run:
            self.planned[step.name] = step.argv
            self.echo(f"== dry-run {step.name}: {shlex.join(step.argv)}")
            return None
        if self.left() < step.need_s:
            self.echo(f"== {step.name}: skipped, {self.left()}s of the budget left (needs {step.need_s:g})")
            return None
        self.echo(f"== {time.strftime('%T')} {step.name} (at {self.spent()}s)")
        log = self.log_of(step.name)
        offset = log.stat().st_size if log is not None and log.is_file() and log == self.log_file else 0
        rc = self._execute(step, log)
        self.status[step.name] = rc
        if rc != 0 and step.required:
            self.failed.append(step.name)
        self.echo(f"== {time.strftime('%T')} {step.name} rc={rc} ({self.spent()}s)")
        self._show(log, offset)
        return rc

    def capture(self, argv: list[str], stderr: Path | None = None) -> str:
        """A command's standard output, for a decision between steps ('' in a dry run or when it fails to start)."""
        if self.dry_run:
            return ""
        err = stderr.open("w") if stderr is not None else subprocess.DEVNULL
        try:
            out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=self._env())
        except OSError:
            return ""
        finally:
            if stderr is not None:
                err.close()
        return out.stdout.strip()

    def log_of(self, name: str) -> Path | None:
        if self.log_file is not None:
            return self.log_file
        return None if self.logs is None else self.logs / f"{name}.log"

    def _env(self) -> dict[str, str] | None:
        return None if self.env is None else dict(self.env)

    def _execute(self, step: Step, log: Path | None) -> int:
        self.console.flush()
        sink = log.open("a" if log == self.log_file else "w") if log is not None else None
        try:
            proc = subprocess.Popen(step.argv, stdout=sink, stderr=subprocess.STDOUT, env=self._env(),
                                    start_new_session=step.timeout_s is not None)
        except OSError as e:
            print(f"{step.argv[0]}: {e}", file=sink or self.console, flush=True)
            return 127
        finally:
            if sink is not None:
                sink.close()
        return wait_or_end(proc, step.timeout_s)

    def _show(self, log: Path | None, offset: int) -> None:
        """The step's lines of interest: the last `lines` of them (of its part of a shared log)."""
        if log is None or not log.is_file() or self.lines <= 0:
            return
        with log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        pattern = re.compile(self.shows)
        shown = [line for line in text.splitlines() if pattern.search(line)]
        for line in shown[-self.lines:]:
            self.echo(line)


def wait_or_end(proc: subprocess.Popen, timeout_s: float | None, grace_s: float = KILL_GRACE_S) -> int:
    """The process's exit status; after timeout_s its process group gets SIGTERM, then SIGKILL after grace_s,
    and the status is TIMED_OUT."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)   # what the leader left behind in its group
        return TIMED_OUT


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
