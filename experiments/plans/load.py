"""One answer per load on the H200 host (SmolLM2-135M, SGLang 0.5.14), started in the background by `bin/h200 load`
from a copy of the code: the closed-loop sweep (baseline; B at 2/4/8 steps, A at 2/4/8 draft tokens, each narrowed by
b_steps / a_k; c = 1/4/16/64 on first-seen prompts), a Poisson rate sweep (baseline and A), the recommendation from
both, then the recommended configuration measured under the open-loop load it was chosen for against a fresh
baseline under the same load. Most valuable first; a failed step is logged and the plan goes on; no step starts once
budget_s have passed. Results under $OUT/load (a log per step, the recommendations), the offline store packed into
$OUT/runs.tar.gz after every runner step."""
from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.plans.host import Host, multirun, py, runner
from experiments.plans.plan import Plan
from experiments.plans.steps import STEP_SHOWS, Item, Runner, Step

EXPERIMENT = "smollm2_135m@h200"
# open loop: one level of 128 first-seen prompts, arrivals as vllm bench serve draws them, at most 64 in flight
OPEN = ("workload.num_prompts=128", "workload.concurrency=64", "workload.arrival=poisson", "workload.arrival_seed=0")


@dataclass(frozen=True)
class Settings:
    """rates: the Poisson sweep's arrival rates (req/s; the confirmation runs at the last); b_steps, a_k, open_k:
    the sweeps' values; gpu_tests: test paths of GPU-marked tests run first (they took a fifth of the 2026-12-03
    lease: the INT4 self-check builds SGLang's JIT kernels, so by default none); overrides: added to every runner
    step's common overrides."""
    budget_s: float = 1300
    rates: str = "8,32"
    b_steps: str = "2,4,8"
    a_k: str = "2,4,8"
    open_k: str = "8"
    gpu_tests: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()


def common(s: Settings, host: Host) -> tuple[str, ...]:
    """Closed loop: the mixed workload, 4 levels x 64 disjoint first-seen prompts, 96 tokens; one stored baseline for
    each sweep, one slice per level (64 prompts at c = 64 leave no room for blocks)."""
    return ("workload=mixed", "workload.num_prompts=256", "workload.max_tokens=96", "workload.concurrency=[1,4,16,64]",
            "baseline.timing=sequential", "workload.blocks=1", f"tracking.uri={host.store}", *s.overrides)


def recommend(host: Host, k: Path, name: str) -> Step:
    """The recommendation from every run so far, into $OUT/load/NAME."""
    return Step(f"recommend-{name}", py("experiments.analysis.recommend", "--experiment", EXPERIMENT,
                                        "--tracking-uri", host.store, "--out", f"{k}/{name}"))


def items(s: Settings, host: Host, run: Runner) -> Iterator[Item]:
    k = host.out / "load"
    com = common(s, host)
    if s.gpu_tests:   # on the host's torch (no MLflow there: the root conftest is not loaded)
        yield Step("gpu-tests", py("pytest", "--noconftest", "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider",
                                   "-q", *s.gpu_tests))
    yield runner(host, k, "baseline", com, "+option=baseline")
    yield multirun(host, "B", com, "+option=B", f"spec.num_steps={s.b_steps}")
    yield multirun(host, "A", com, "+option=A", f"spec.num_draft_tokens={s.a_k}")
    yield recommend(host, k, "closed")
    yield multirun(host, "poisson-baseline", com, "+option=baseline", *OPEN, f"workload.rate={s.rates}")
    yield multirun(host, "poisson-A", com, "+option=A", f"spec.num_draft_tokens={s.open_k}", *OPEN,
                   f"workload.rate={s.rates}")
    yield recommend(host, k, "all")
    yield from confirm(s, host, run, k, com)


def confirm(s: Settings, host: Host, run: Runner, k: Path, com: tuple[str, ...]) -> Iterator[Item]:
    """The recommended configuration at the highest rate, measured again on another sample (workload.seed=1:
    prompts and arrivals the servers have not seen, so the baseline is measured afresh under the same load)."""
    rate = s.rates.split(",")[-1]
    choice = run.capture(list(py("experiments.analysis.recommend.remeasure", f"{k}/all", "--arrival", "poisson",
                                 "--rate", rate, "--tracking-uri", host.store)), stderr=k / "confirm-choice.log")
    run.echo(f"== confirm: the recommendation at poisson {rate} req/s: {choice or 'none (see confirm-choice.log)'}")
    if choice:
        yield runner(host, k, "confirm", com, *shlex.split(choice), *OPEN, f"workload.rate={rate}",
                     "workload.seed=1", "run.name=confirm")


def env(s: Any, host: Host) -> dict[str, str]:
    return host.env(keep_pythonpath=True)


PLAN = Plan("load", Settings, items, logs="load", env=env,
            shows=STEP_SHOWS + "| passed| skipped|recommend|no speculation|speedup")
