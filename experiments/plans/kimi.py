"""The Kimi-K2.5 miniature's measurements on the H200 host (`bin/h200 kimi` starts it in the background from a copy
of the code). Most valuable first; a step that fails is logged and the plan goes on; no step starts once budget_s
have passed (the lease is short). Results under $OUT/kimi (one log per step, kernel JSON, the served-telemetry
JSON) and the offline store packed into $OUT/runs.tar.gz after every runner step."""
from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from experiments.plans.host import Host, pack, py, runner
from experiments.plans.plan import Plan
from experiments.plans.steps import Action, Item, Runner, Step


@dataclass(frozen=True)
class Settings:
    """budget_s: with the JIT kernels prebuilt (jit_prebuild) the whole plan ran 1,100 s on 2026-12-02.
    kernels: rerun the INT4 kernel microbenchmark (its table is in docs/journal/2026-12-02-h200); without the
    prebuilt kernel it also builds Marlin first. overrides: added to every runner step's common overrides."""
    budget_s: float = 1000
    kernels: bool = False
    overrides: tuple[str, ...] = ()


def model(host: Host) -> Path:
    return host.cache / "models" / "kimi-k25-mini"


def common(s: Settings, host: Host) -> tuple[str, ...]:
    """Every runner step: the mixed workload (all categories), 4 levels x 64 disjoint first-seen prompts, 64 tokens."""
    return ("site=h200-kimi", f"model.path={model(host)}", "workload=mixed", "workload.num_prompts=256",
            "workload.max_tokens=64", "workload.concurrency=[1,4,16,64]", f"tracking.uri={host.store}", *s.overrides)


def serve(host: Host) -> tuple[str, ...]:
    return ("--model", str(model(host)), "--model-config", "kimi_k25_mini", "--site", "h200-kimi", "--copies", "3",
            "--pass-prompts", "8", "--max-new-tokens", "32", "--concurrency", "1,4,16,64")


def items(s: Settings, host: Host, run: Runner) -> Iterator[Item]:
    k = host.out / "kimi"
    com = common(s, host)
    # Marlin's MoE kernel is built by JIT on first use: 5-7 min cold on the H200 host (2026-12-02), unless the
    # bundle carried it prebuilt (experiments.hosts.jit_prebuild)
    yield Step("build", py("experiments.box.kimi_mini", "build", "--out", str(model(host))))
    if s.kernels:
        yield Step("kernels", py("experiments.box.kimi_kernels", "--out", f"{k}/kernels.json", "--quick"))
    # option E with CUDA graphs per budget, one fresh server each: every level warmed up first, passes of 64
    # requests of 128 tokens, the budgets in both orders (the first server of each order was slow, kimi_lease3)
    graphs = ("--phase", "graphs", "--graph-k", "4", "--pass-prompts", "64", "--max-new-tokens", "128")
    h200_serve = "experiments.moe.h200_serve"
    yield Step("graphs", py(h200_serve, *serve(host), *graphs, "--out", f"{k}/serve", "--budgets", "384,64,16"))
    yield Step("graphs-reverse", py(h200_serve, *serve(host), *graphs, "--out", f"{k}/serve-reverse",
                                    "--budgets", "16,64,384"))
    yield runner(host, k, "baseline", com, "+option=baseline")
    yield runner(host, k, "B", com, "+option=B")    # random head: the drafter's cost, not a verdict
    yield runner(host, k, "E", com, "+option=E")
    # B's step at c = 1 under max_running_requests 8 and 64, back to back on the same 32 prompts (unpaired: the
    # question is B's own step time; on 2026-12-01 this limit was the only flag that differed)
    c1 = ("workload.concurrency=[1]", "workload.num_prompts=32", "baseline.pair=false")
    yield runner(host, k, "B-mrr8", com, "+option=B", *c1, "limits.max_running_requests=8", "run.name=B-c1-mrr8")
    yield runner(host, k, "B-mrr64", com, "+option=B", *c1, "limits.max_running_requests=64", "run.name=B-c1-mrr64")
    yield Step("selfcheck", py("sglang_patches.selfcheck", "--json", f"{k}/selfcheck.json"))
    yield runner(host, k, "A", com, "+option=A")
    # A at 2 and 8 draft tokens: the verification-cost probe the speedup model fits on SGLang
    yield runner(host, k, "A-k2", com, "+option=A", "spec.num_draft_tokens=2", "run.name=A-k2")
    yield runner(host, k, "A-k8", com, "+option=A", "spec.num_draft_tokens=8", "run.name=A-k8")
    # NGRAM verifies bs x (k+1) tokens per step whatever is accepted: the budget grid at k = 4, then k = 2 and 8
    yield Step("telemetry-ngram", py(h200_serve, *serve(host), "--out", f"{k}/serve", "--phase", "ngram",
                                     "--ks", "4,2,8", "--budget-k", "4", "--budgets", "384,128,64,32,16"))
    yield Step("telemetry-decode", py(h200_serve, *serve(host), "--out", f"{k}/serve", "--phase", "decode"))
    # 0.25-0.60x Marlin's served tok/s, measured twice on 2026-12-02: last
    yield runner(host, k, "baseline-triton", com, "+option=baseline", "site.patches=[sm12x_wna16_moe_triton]",
                 "+site.patches_forced=[sm12x_wna16_moe_triton]", "run.name=baseline-triton-forced")
    yield Action(lambda: pack(k / "serve.tar.gz", k, ["serve", "serve-reverse"]))
    yield Action(lambda: list_jit_cache(k / "jit_cache.txt"))


def list_jit_cache(into: Path) -> None:
    """Which JIT kernels the host built itself (newer than the prebuilt ones): the list to prebuild next time."""
    cache = os.environ.get("TVM_FFI_CACHE_DIR") or str(Path.home() / ".cache" / "tvm-ffi")
    with into.open("w") as f:
        subprocess.run(f"ls -la --time-style=+%T {shlex.quote(cache)}/*/", shell=True, stdout=f,
                       stderr=subprocess.STDOUT)


PLAN = Plan("kimi", Settings, items, logs="kimi")
