"""The step-cost probe on the current site: engine step time against batch size and verify width
(conf/workload/probe.yaml), measured by the ordinary runner, for experiments.analysis.speedup.stepcost to fit. Two
multiruns of workload=probe: option A at 2, 4 and 8 draft tokens, then the site's EAGLE-3 option (`eagle`: B on an
SGLang site, C on a vLLM one) at 1 and 3 draft steps. The first run measures the paired baseline, every later one
finds it in the store. `overrides` go to every run:
  bin/probe -- 'workload.concurrency=[1,2,4]'                                   # here, on the CPU
  bin/probe eagle=B -- tracking.uri=offline:///tmp/specws/runs                  # the H200 (bin/h200 probe)
The steps run on this interpreter, their output on the console; pack_store=true packs the offline store under
$SPECWS_DEST into $OUT/runs.tar.gz after each multirun. At the end the fit's command is printed and, with fit=true
where experiments/analysis/speedup/probe.py exists, run (its outcome leaves the exit status, which says whether
every multirun succeeded)."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from experiments.plans.host import Host
from experiments.plans.plan import Plan
from experiments.plans.steps import Item, Runner, Step

FIT_MODULE = "experiments.analysis.speedup.probe"


@dataclass(frozen=True)
class Settings:
    eagle: Literal["B", "C"] = "C"
    fit: bool = True
    pack_store: bool = False
    overrides: tuple[str, ...] = ()


def extra(s: Settings) -> tuple[str, ...]:
    """One stored baseline for every run of the probe, its levels one slice each (the step costs need no pairing
    in time), then the caller's overrides."""
    return ("baseline.timing=sequential", "workload.blocks=1", *s.overrides)


def multirun(s: Settings, host: Host, name: str, *overrides: str) -> Step:
    step = Step(name, (sys.executable, "-m", "experiments.run", "-m", "workload=probe", *overrides, *extra(s)))
    return dataclasses.replace(step, after=host.pack_store) if s.pack_store else step


def items(s: Settings, host: Host, run: Runner) -> Iterator[Item]:
    yield multirun(s, host, "A", "+option=A", "spec.num_draft_tokens=2,4,8")
    yield multirun(s, host, s.eagle, f"+option={s.eagle}", "spec.num_steps=1,3")
    experiment, uri = tracking(s, run)
    fit = (sys.executable, "-m", FIT_MODULE, "fit", "--experiment", experiment or "<model>@<site>",
           "--tracking-uri", uri or "<tracking uri>")
    run.echo(f"== probe: fit with: {' '.join(fit)}")
    if s.fit and experiment and fit_module_present():
        yield Step("fit", fit, required=False)


def tracking(s: Settings, run: Runner) -> tuple[str, str]:
    """(experiment, store URI) the runs went to, as the runner composes them ('' where unknown)."""
    out = run.capture([sys.executable, "-m", "experiments.run", "+option=A", "workload=probe", *extra(s), "--cfg",
                       "job", "--resolve", "-p", "tracking"])
    found = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return found.get("experiment", ""), found.get("uri", "")


def fit_module_present() -> bool:
    import experiments
    return (Path(experiments.__file__).parent / "analysis" / "speedup" / "probe.py").is_file()


def env(s: Any, host: Host) -> dict[str, str] | None:
    return None


PLAN = Plan("probe", Settings, items, logs=None, env=env, marks_done=False)
