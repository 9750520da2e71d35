"""Replay speed: output tokens replayed per second per n-gram configuration, one core.

`python -m experiments.bench.replay_throughput [--records FILE] [--copies 400]`: the records (default: a synthetic
workload whose outputs copy spans of their prompts) are tiled `copies` times; reported are the time of the
first configuration (index built from scratch) and the mean over a grid that shares the index.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from experiments.analysis.replay import (  # noqa: E402
    NgramConfig,
    NgramIndex,
    ReplaySequence,
    replay_config,
    sequences_from_records,  # noqa: E402
)
from experiments.tracking.records import load_records  # noqa: E402


def synthetic(n_requests: int, rng: np.random.Generator) -> list[ReplaySequence]:
    """Prompts of 150 tokens from a 49k vocabulary; outputs of 160 tokens that copy prompt spans half the time."""
    seqs = []
    for _ in range(n_requests):
        prompt = rng.integers(0, 49152, 150).tolist()
        out: list[int] = []
        while len(out) < 160:
            if rng.random() < 0.5:
                s = int(rng.integers(0, 140))
                out += prompt[s: s + int(rng.integers(3, 12))]
            else:
                out += rng.integers(0, 49152, int(rng.integers(1, 6))).tolist()
        seqs.append(ReplaySequence(prompt, out[:160]))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", default=None)
    ap.add_argument("--copies", type=int, default=400)
    ap.add_argument("--requests", type=int, default=6000, help="synthetic requests when no --records")
    args = ap.parse_args()
    if os.sched_getaffinity(0) and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if args.records:
        base = sequences_from_records(load_records(args.records), args.records)
        seqs = base * args.copies
    else:
        seqs = synthetic(args.requests, np.random.default_rng(0))
    out_tokens = sum(len(s.output_ids) for s in seqs)
    all_tokens = out_tokens + sum(len(s.prompt_ids) for s in seqs)
    grid = [NgramConfig(a, b, k) for a in (1, 2) for b in (2, 4) for k in (2, 4, 8)]
    # CPU time of this (single-threaded) process: wall time on a shared machine measures the neighbours
    w0, c0 = time.perf_counter(), time.process_time()
    index = NgramIndex(seqs, 4)
    replay_config(index, grid[0])
    cold = (time.perf_counter() - w0, time.process_time() - c0)
    w0, c0 = time.perf_counter(), time.process_time()
    for cfg in grid:
        replay_config(index, cfg)
    warm = ((time.perf_counter() - w0) / len(grid), (time.process_time() - c0) / len(grid))
    print(f"{len(seqs)} requests, {out_tokens} output tokens ({all_tokens} with prompts), 1 core, "
          f"load average {os.getloadavg()[0]:.1f}")
    for what, (wall, cpu) in (("first configuration incl. index build", cold),
                              (f"per configuration over a {len(grid)}-point grid sharing the index", warm)):
        print(f"{what}: CPU {cpu:.3f} s = {out_tokens / cpu / 1e6:.2f} M output tok/s "
              f"({all_tokens / cpu / 1e6:.2f} M tok/s incl. prompts); wall {wall:.3f} s = "
              f"{out_tokens / wall / 1e6:.2f} M output tok/s")


if __name__ == "__main__":
    main()
