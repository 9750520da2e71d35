"""A plan: its settings (a dataclass of knobs with defaults), its items (a generator of steps and actions, read
lazily so that a decision between steps sees what the steps before it left on disk), where its logs go and what
they show. `run_plan` runs one on the host; `planned` returns the command lines a dry run would print."""
from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from experiments.plans.host import Host
from experiments.plans.steps import STEP_LINES, STEP_SHOWS, Item, Runner

Items = Callable[[Any, Host, Runner], Iterator[Item]]


def bundle_env(settings: Any, host: Host) -> dict[str, str]:
    return host.env()


@dataclass(frozen=True)
class Plan:
    """logs: its results under $OUT/<logs>, one log per step; log_file: instead, one log under $OUT that every
    step appends to; neither: the steps' output on the console. env: the steps' environment (None: this
    process's); marks_done: the plan ends by touching $SPECWS_DEST/plan.done, which `bin/h200 wait` waits for."""
    name: str
    settings: type
    items: Items
    logs: str | None
    log_file: str | None = None
    env: Callable[[Any, Host], dict[str, str] | None] = bundle_env
    shows: str = STEP_SHOWS
    lines: int = STEP_LINES
    marks_done: bool = True


def runner_for(plan: Plan, settings: Any, host: Host, dry_run: bool, console: TextIO | None = None) -> Runner:
    logs = None if plan.logs is None else host.out / plan.logs
    log_file = None if plan.log_file is None else host.out / plan.log_file
    runner = Runner(getattr(settings, "budget_s", None), logs, dry_run, log_file, plan.shows, plan.lines,
                    plan.env(settings, host))
    if console is not None:
        runner.console = console
    return runner


def run_plan(plan: Plan, settings: Any, host: Host, dry_run: bool = False, console: TextIO | None = None,
             mark_done: bool = False) -> int:
    """The plan's items in order; 0 when every required step that ran succeeded. mark_done: touch plan.done at
    the end even where the plan does not."""
    runner = runner_for(plan, settings, host, dry_run, console)
    if not dry_run:
        for folder in (runner.logs, runner.log_file and runner.log_file.parent):
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
    rc = runner.run(plan.items(settings, host, runner))
    if plan.marks_done or mark_done:
        runner.echo(f"== plan done at {runner.spent()}s")
        if not dry_run:
            host.done.parent.mkdir(parents=True, exist_ok=True)
            host.done.touch()
    return rc


def planned(plan: Plan, settings: Any, host: Host) -> dict[str, tuple[str, ...]]:
    """Step name -> command line, in order, as a dry run of the plan under host prints them."""
    runner = runner_for(plan, settings, host, dry_run=True, console=io.StringIO())
    runner.run(plan.items(settings, host, runner))
    return runner.planned
