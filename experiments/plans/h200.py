"""The plain measurements of the H200 host (SmolLM2-135M, SGLang 0.5.14), as `bin/h200` starts them: `measure`
(each option on the chat and grounded prompt sets, in the foreground), `standard` (baseline, A at 8/4/2 draft tokens
and B at c = 1/4/8, in the background, the store packed after each) and `pairs` (option B against the baseline on the
chat set at c = 1 and 8, in rounds: paired in time, both servers up, blocks in ABBA order, or the old way, a fresh
baseline then B). Every step's output is appended to $OUT/measure.log, its lines of interest echoed."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from experiments.plans.host import RUN, Host, py
from experiments.plans.plan import Plan
from experiments.plans.steps import Action, Item, Runner, Step

SHOWS = "MLflow run|accept_length|output_tok_s|refused|Error|error"
LINES = 40
LEVELS = "workload.concurrency=[1,4,8]"


@dataclass(frozen=True)
class MeasureSettings:
    """options: measured in turn, comma-separated; workloads: one multirun over them; overrides: after the rest."""
    options: str = "baseline,A,B"
    workloads: str = "grounded,chat"
    overrides: tuple[str, ...] = ()


def measure(host: Host, option: str, workloads: str, *overrides: str) -> Step:
    """One option over the workloads with the ordinary runner, into the offline store."""
    return Step(f"measure-{option}", (*RUN, "-m", f"+option={option}", f"workload={workloads}",
                                      f"tracking.uri={host.store}", f"hydra.sweep.dir={host.dest}/sweeps/{option}",
                                      *overrides))


def measure_items(s: MeasureSettings, host: Host, run: Runner) -> Iterator[Item]:
    for option in filter(None, s.options.split(",")):
        yield measure(host, option, s.workloads, *s.overrides)


@dataclass(frozen=True)
class StandardSettings:
    workloads: str = "grounded,chat"
    overrides: tuple[str, ...] = ()


def standard_items(s: StandardSettings, host: Host, run: Runner) -> Iterator[Item]:
    """baseline, A at 8/4/2 draft tokens and B, on chat and grounded at c = 1/4/8, each prompt measured once."""
    for option, own in (("baseline", ()), ("A", ("spec.num_draft_tokens=8,4,2",)), ("B", ())):
        yield measure(host, option, s.workloads, LEVELS, *own, *s.overrides)
        yield Action(host.pack_store)


@dataclass(frozen=True)
class PairsSettings:
    """rounds: each a pairing (interleaved: both servers up, blocks in ABBA order; sequential: a fresh baseline,
    then B); idle: then whether an idle SGLang server disturbs the measured one."""
    rounds: tuple[str, ...] = ("interleaved", "sequential", "interleaved")
    idle: bool = False
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rounds) - {"interleaved", "sequential"})
        if unknown:
            raise ValueError(f"rounds: {unknown} are not interleaved or sequential")


def pairs_items(s: PairsSettings, host: Host, run: Runner) -> Iterator[Item]:
    for i, timing in enumerate(s.rounds, 1):
        run.echo(f"== round {timing} at {time.strftime('%T')}")
        # one warm-up: the 65 chat prompts hold 1 + 2 levels x 4 blocks x 8 (two warm-ups were refused, 2026-12-05)
        hydra = f"hydra.run.dir={host.dest}/outputs/{timing}-{time.strftime('%H%M%S')}"
        yield Step(f"round{i}-{timing}", (*RUN, "+option=B", "workload=chat", "workload.concurrency=[1,8]",
                                          "workload.warmup_requests=1", "workload.blocks=4", "baseline.lookup=false",
                                          f"baseline.timing={timing}", f"run.name=B-{timing}",
                                          f"tracking.uri={host.store}", hydra, *s.overrides),
                   after=host.pack_store)
    if s.idle:
        yield Step("idle-server", py("experiments.bench.idle_server", "--site", "h200", "--prompts", "16", "--tokens",
                                     "128", "--out", f"{host.out}/idle_server_h200.json"))


MEASURE = Plan("measure", MeasureSettings, measure_items, logs=None, log_file="measure.log", shows=SHOWS,
               lines=LINES, marks_done=False)
STANDARD = Plan("standard", StandardSettings, standard_items, logs=None, log_file="measure.log", shows=SHOWS,
                lines=LINES)
PAIRS = Plan("pairs", PairsSettings, pairs_items, logs=None, log_file="measure.log", shows=SHOWS, lines=LINES)
