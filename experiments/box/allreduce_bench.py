"""All-reduce bus bandwidth on this host's GPUs, nccl-tests style, through torch.distributed.

`python -m experiments.box.allreduce_bench --gpus 8 --out allreduce.json [--backend nccl|gloo]`

One process per device (torch.multiprocessing). Sizes run from Kimi-K2.5's per-step all-reduce (hidden 7168
bf16 x tokens 1...512: what every TP layer reduces twice per decode step at that batch) up to 256 MiB. As
nccl-tests defines them (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
    algbw = bytes / time          busbw = algbw * 2 (n - 1) / n
busbw is comparable across rank counts and with the link's peak. The NCCL_* / NVSHMEM / symmetric-memory
variables in force are recorded with the results, since they decide the path (NVLink, SHM, network).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.config.kimi import KIMI

KIMI_HIDDEN = KIMI.hidden
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIB = 1 << 20
RECORDED_ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL")


def kimi_sizes(max_bytes: int = 256 * MIB, tokens: tuple[int, ...] = TOKENS) -> list[int]:
    """Bytes of bf16 [tokens, 7168] activations, then powers of two from 8 MiB up to max_bytes."""
    sizes = [t * KIMI_HIDDEN * 2 for t in tokens]
    size = 8 * MIB
    while size <= max_bytes:
        if size > sizes[-1]:
            sizes.append(size)
        size *= 2
    return sorted(s for s in set(sizes) if s <= max_bytes)


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2 (n - 1) / n."""
    return algbw * 2 * (ranks - 1) / ranks


def recorded_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV_PREFIXES)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(nbytes: int, device: torch.device, warmup: int, iters: int) -> float:
    """Mean seconds per all-reduce of `nbytes` of bf16 (float32 on CPU, where gloo has no bf16 sum)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elements = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    buf = torch.ones(elements, dtype=dtype, device=device)
    for _ in range(warmup):
        dist.all_reduce(buf)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    elapsed = time.perf_counter() - start
    # the slowest rank's time is the collective's time, as nccl-tests reports
    took = torch.tensor([elapsed / iters], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=_cpu_group())
    return float(took.item())


_CPU_GROUP = None


def _cpu_group():
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def measure(sizes: list[int], device: torch.device, warmup: int, iters: int) -> list[dict]:
    ranks = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        seconds = time_all_reduce(nbytes, device, warmup, iters)
        algbw = nbytes / seconds / 1e9
        rows.append({"bytes": nbytes, "tokens": nbytes // (KIMI_HIDDEN * 2) if nbytes % (KIMI_HIDDEN * 2) == 0
                     else None, "time_us": seconds * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": bus_bandwidth(algbw, ranks)})
    return rows


def _worker(rank: int, ranks: int, port: int, args: argparse.Namespace) -> None:
    global _CPU_GROUP
    _CPU_GROUP = None
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        rows = measure(args.sizes, device, args.warmup, args.iters)
        if rank == 0:
            result = {"backend": args.backend, "ranks": ranks, "torch": torch.__version__,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                      "definition": "algbw = bytes/time; busbw = algbw * 2(n-1)/n (nccl-tests PERFORMANCE.md)",
                      "env": recorded_env(), "warmup": args.warmup, "iters": args.iters, "rows": rows}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(gpus: int, out: str, backend: str = "nccl", sizes: list[int] | None = None,
        warmup: int = 5, iters: int = 20) -> dict:
    """Spawn `gpus` ranks, measure, return what rank 0 wrote to `out`."""
    args = argparse.Namespace(out=out, backend=backend, sizes=sizes or kimi_sizes(), warmup=warmup, iters=iters)
    mp.spawn(_worker, args=(gpus, free_port(), args), nprocs=gpus, join=True)
    return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.box.allreduce_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    result = run(a.gpus, a.out, a.backend, kimi_sizes(a.max_mib * MIB), a.warmup, a.iters)
    print(f"{'bytes':>12} {'tokens':>6} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in result["rows"]:
        print(f"{r['bytes']:>12} {r['tokens'] or '':>6} {r['time_us']:>10.1f} {r['algbw_gbs']:>11.2f} "
              f"{r['busbw_gbs']:>11.2f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
