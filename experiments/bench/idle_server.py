"""Does an idle server disturb the one being measured? The condition for pairing option and baseline in time on
one machine (baseline.timing=interleaved): both servers stay up, and the idle one must leave the cores (or the GPU)
to the active one.

`python -m experiments.bench.idle_server [--site local] [--prompts 8] [--tokens 64] [--out FILE]`: one server (the
site's baseline command line) measured at c = 1 alone, then with a second, idle server of the same command line up
beside it, then alone again (bracketing drift); the idle server's own CPU time is read from its process group over
a quiet window. Each pass sends its own first-seen prompts. Output: JSON with tok/s per pass, the ratio of the pass
beside the idle server over the mean of the two alone, and the idle server's cores busy.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil
from hydra import compose, initialize_config_dir

from experiments.config import paths
from experiments.config.views import views_of
from experiments.engines import adapter_for
from experiments.harness.calibration import EngineCpu, server_processes
from experiments.harness.client import RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.launch import build_launch_spec
from experiments.harness.server import Server
from experiments.harness.workloads.sampling import plan_visits

QUIET_S = 20.0


def _cfg(site: str):
    with initialize_config_dir(config_dir=str(paths.ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["+option=baseline", f"site={site}",
                                                        "workload.concurrency=[1]"])


def _pass(server: Server, engine: str, model: str, prompts: int, tokens: int, seed: int, tmp: Path) -> float:
    """Output tok/s at c = 1 over `prompts` prompts of random token ids the server has not seen."""
    rng = random.Random(seed)
    ids = {f"s{seed}p{i}": [rng.randrange(1000, 40000) for _ in range(48)] for i in range(prompts)}
    convs, render = fixed_prompts(ids)
    plan = plan_visits(convs, [1], 1, 0, seed)
    runner = WorkloadRunner(server, adapter_for(engine), model, RequestSettings(tokens, 0.0, seed, 600), render,
                            tmp / f"pass-{seed}.jsonl")
    (level,) = runner.run(plan)
    ok = [r for r in level.records if r.error is None]
    return sum(len(r.output_token_ids) for r in ok) / level.wall_s


def _cores_busy(server: Server, seconds: float) -> float:
    """CPU seconds per second used by the server's processes over `seconds` of no requests."""
    cpu = EngineCpu()
    cpu.start("idle", server_processes(server))
    time.sleep(seconds)
    window = cpu.stop("idle")
    return window["cpu_s"] / window["wall_s"]


def measure(site: str, prompts: int, tokens: int) -> dict:
    cfg = _cfg(site)
    spec = build_launch_spec(views_of(cfg))
    tmp = Path(tempfile.mkdtemp(prefix="specws-idle-"))
    active = Server(spec, tmp / "active.log")
    active.start(900)
    idle = None
    try:
        _pass(active, spec.engine, str(cfg.model.name), 2, tokens, 0, tmp)   # warm-up
        alone_before = _pass(active, spec.engine, str(cfg.model.name), prompts, tokens, 1, tmp)
        idle = Server(replace(spec, port=0), tmp / "idle.log")   # its own port
        idle.start(900)
        _pass(idle, spec.engine, str(cfg.model.name), 2, tokens, 2, tmp)     # as the interleaved pair warms both
        idle_cores = _cores_busy(idle, QUIET_S)
        beside = _pass(active, spec.engine, str(cfg.model.name), prompts, tokens, 3, tmp)
        idle.stop()
        idle = None
        alone_after = _pass(active, spec.engine, str(cfg.model.name), prompts, tokens, 4, tmp)
    finally:
        for server in (active, idle):
            if server is not None:
                server.stop()
    alone = (alone_before + alone_after) / 2
    return {"site": site, "engine": spec.engine, "prompts": prompts, "tokens": tokens, "cpus": psutil.cpu_count(),
            "tok_s_alone_before": alone_before, "tok_s_beside_idle": beside, "tok_s_alone_after": alone_after,
            "ratio_beside_over_alone": beside / alone, "alone_drift": alone_after / alone_before,
            "idle_server_cores_busy": idle_cores, "quiet_window_s": QUIET_S}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default="local")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = measure(args.site, args.prompts, args.tokens)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
