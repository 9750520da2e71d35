"""Kimi-K2.5 at full depth (the 61-layer miniature, random weights) at TP 8 on an 8x H200 host, all-reduce off NVLink
(site h200x8-kimi), started like the kimi plan from a copy of the code (`bin/h200 tp8`). Most valuable first; a
failing step is logged and the plan goes on; no step starts once budget_s have passed. Results under $OUT/tp8 (one
log per step, allreduce*.json, decode traces and decode_profile-c*.json, tp_workers.json) and the offline store
packed into $OUT/runs.tar.gz after each runner step. gpus=2 or 4 runs only the steps that need no TP-8 server (the
all-reduce benchmark), see docs/reference/tp8.md."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.plans.host import Host, pack, py, runner
from experiments.plans.plan import Plan
from experiments.plans.steps import STEP_SHOWS, Action, Item, Runner, Step

# NVLink multicast off in every process this plan starts, whatever the host's defaults (the site sets them too)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Settings:
    """gpus: the host's GPUs (fewer than 8: the all-reduce benchmark only); overrides: added to every runner
    step's common overrides."""
    budget_s: float = 1500
    gpus: int = 8
    overrides: tuple[str, ...] = ()


def model(host: Host) -> Path:
    return host.cache / "models" / "kimi-k25-mini-61"


def common(s: Settings, host: Host) -> tuple[str, ...]:
    return ("site=h200x8-kimi", f"model.path={model(host)}", "model.hf_config.num_hidden_layers=61", "workload=mixed",
            "workload.num_prompts=320", "workload.max_tokens=64", "workload.concurrency=[1,4,16,64,128]",
            f"tracking.uri={host.store}", *s.overrides)


def items(s: Settings, host: Host, run: Runner) -> Iterator[Item]:
    k = host.out / "tp8"
    # the all-reduce as the site runs it (SHM through host memory), then over NVLink P2P for the gap
    yield Step("allreduce", ("env", "NCCL_P2P_DISABLE=1", *py("experiments.box.allreduce_bench", "--gpus",
                                                              str(s.gpus), "--out", f"{k}/allreduce.json")))
    yield Step("allreduce-nvlink", py("experiments.box.allreduce_bench", "--gpus", str(s.gpus), "--out",
                                      f"{k}/allreduce-nvlink.json"))
    if s.gpus < 8:
        run.echo(f"== gpus={s.gpus}: the TP-8 steps need 8 GPUs")
        return
    yield from tp8_steps(s, host, k)


def tp8_steps(s: Settings, host: Host, k: Path) -> Iterator[Item]:
    com = common(s, host)
    yield Step("build", py("experiments.box.kimi_mini", "build", "--out", str(model(host)), "--layers", "61"))
    yield Step("trace", py("experiments.box.decode_trace", "--model", str(model(host)), "--site", "h200x8-kimi",
                           "--out", f"{k}/trace", "--override", "model.hf_config.num_hidden_layers=61",
                           "--concurrency", "1,128"))
    for c in (1, 128):
        # rank 0's trace: every rank runs the same kernels, and the all-reduce's wait shows on each
        traces = sorted((k / "trace" / f"c{c}").glob("*TP-0*.trace.json.gz"))
        if traces:
            yield Step(f"profile-c{c}", py("experiments.box.decode_profile", str(traces[0]), "--json",
                                           f"{k}/decode_profile-c{c}.json"))
    yield runner(host, k, "baseline", com, "+option=baseline")
    yield runner(host, k, "E", com, "+option=E")
    yield Step("tp-workers", ("bash", "-c", f'python3 -m experiments.box.tp_workers "$(ls -t {host.dest}/hydra/E/'
                                            f'server-*.log | head -n 1)" --tp 8 --json {k}/tp_workers.json'))
    yield runner(host, k, "B", com, "+option=B")
    yield runner(host, k, "A", com, "+option=A")
    yield Action(lambda: pack(k / "trace.tar.gz", k, ["trace"]))


def env(s: Any, host: Host) -> dict[str, str]:
    return host.env(**NO_MULTICAST)


PLAN = Plan("tp8", Settings, items, logs="tp8", env=env, shows=STEP_SHOWS + r"|OK:|FAILED:|\| ", lines=14)
