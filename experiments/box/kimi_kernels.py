"""INT4 (W4A16) MoE kernels at Kimi-K2.5's shapes: SGLang's default for compressed-tensors WNA16 MoE on sm_90
(Marlin, `fused_marlin_moe`) against the Triton W4A16 kernel that `sm12x_wna16_moe_triton` selects
(`fused_experts(use_int4_w4a16=True)`), E = 384 experts, top-8, K = 7168, N = 2048 and the TP-8 shard N = 256,
group 32, M = 1 ... 512 tokens. Runs on the H200 host with SGLang 0.5.14 (no mlflow, no hydra):

    python3 -m experiments.box.kimi_kernels --out FILE.json [--quick] [--skew 0.25] [--budget-s 90]

Weights are random INT4 in SGLang's loaded compressed-tensors layout, converted once per kernel as its scheme's
process_weights_after_loading does (sglang_patches.selfcheck: prepare_marlin / prepare_triton / run_prepared),
outside the timed region. Each measurement captures R calls (R different inputs and routings, so that no call
finds the previous call's experts in L2; R = 8 below 64 tokens, 2 from there, where nearly every expert is
touched) into one CUDA graph, replays it 20 times after 2 warm-up replays, and reports the median (CUDA events)
divided by R; a kernel that cannot be captured is timed eagerly the same way (`timing` says which).
Routing: uniform random top-8 at every M, and skewed with the synthetic router's popularity bias (--skew, 0 = none)
at M = 1, 8, 64, 512.
Per row: us per call of each kernel, triton/marlin ratio, distinct experts touched and the effective weight
bandwidth (bytes of the touched experts' packed weights and scales / time). Accuracy: both kernels against the
dequantised torch reference and each other at N = 2048, M = 2.

Time: Marlin's kernels are JIT-built (tvm-ffi + nvcc; cold on the H200 one build took 328 s, another over 380 s;
then cached in $TVM_FFI_CACHE_DIR or ~/.cache/tvm-ffi): a subprocess builds them while Triton is measured, and the
run waits up to --marlin-build-timeout for it. `--prebuild-only` just builds them: start it early in a lease
(`setsid nohup python3 -m experiments.box.kimi_kernels --out x --prebuild-only &`), and a later run finds them.
Triton compiles per config and integer specialisation at a shape's first call (first_call_s; 17-20 s in all).
--budget-s bounds the run's wall time less that wait: Triton's rows must start within 3/4 of it, Marlin's within
the rest; a row past its deadline is not started (listed under left_out). The JSON is rewritten after every
measurement, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from experiments.config.kimi import KIMI
from sglang_patches import selfcheck
from sglang_patches.synthetic_router import popularity_bias

EXPERTS, TOP_K, HIDDEN, GROUP = KIMI.routed_experts, KIMI.top_k, KIMI.hidden, KIMI.group_size
ROUTED_SCALING_FACTOR = 2.827          # Kimi-K2.5 config.json text_config.routed_scaling_factor
N_GRID = (KIMI.moe_intermediate, KIMI.moe_intermediate // 8)   # moe_intermediate_size, and its TP-8 shard
M_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
QUICK_M = (1, 8, 64, 512)
KERNELS = ("triton_w4a16", "marlin_w4a16")
ACCURACY_SHAPE = (2048, 2)             # (N, M)
BUDGET_SHARE = {"triton_w4a16": 3.0, "marlin_w4a16": 1.0}   # of --budget-s: Triton measured ~6x slower on H200
MARLIN_PREBUILD = ("import torch\n"
                   "from sglang.jit_kernel.gptq_marlin_repack import _jit_gptq_marlin_repack_module\n"
                   "from sglang.jit_kernel.moe_wna16_marlin import _jit_moe_wna16_marlin_module\n"
                   "_jit_gptq_marlin_repack_module()\n_jit_moe_wna16_marlin_module(torch.bfloat16)\n")


@dataclass(frozen=True)
class Shape:
    experts: int = EXPERTS
    top_k: int = TOP_K
    hidden: int = HIDDEN
    group_size: int = GROUP


TINY = Shape(experts=16, top_k=4, hidden=256, group_size=32)   # a smoke shape (and the CPU tests')


@dataclass(frozen=True)
class Grid:
    ns: tuple[int, ...]
    ms: tuple[int, ...]
    routings: tuple[tuple[str, float], ...]   # (name, skew)
    skewed_ms: tuple[int, ...] = QUICK_M      # the skewed routing at these M only (it moves the numbers little)
    calls_per_graph: int = 8                 # below rotate_below_m tokens: the touched experts could sit in L2
    calls_per_graph_large: int = 2           # at or above it: >= 287 of 384 experts, far more bytes than L2
    rotate_below_m: int = 64
    replays: int = 20
    warmup_replays: int = 2

    def calls_for(self, tokens: int) -> int:
        return self.calls_per_graph if tokens < self.rotate_below_m else self.calls_per_graph_large


def grid_for(quick: bool, skew: float, tiny: bool = False) -> Grid:
    routings = (("uniform", 0.0),) + (((f"skew{skew:g}", skew),) if skew > 0 and not quick else ())
    if tiny:
        return Grid(ns=(128,), ms=(1, 4), routings=routings, calls_per_graph=2, calls_per_graph_large=2,
                    replays=5, warmup_replays=1)
    if quick:
        return Grid(ns=N_GRID, ms=QUICK_M, routings=routings, calls_per_graph=4, calls_per_graph_large=2)
    return Grid(ns=N_GRID, ms=M_GRID, routings=routings)


def random_layer(shape: Shape, n: int, device: str, seed: int = 0) -> selfcheck.PackedLayer:
    """Random INT4 experts as loaded int32 words (eight uniform nibbles each) and bf16 scales in [0.01, 0.03)."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, k, gs = shape.experts, shape.hidden, shape.group_size

    def words(*size: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, size, generator=g, device=device, dtype=torch.int32)

    def scales(*size: int) -> torch.Tensor:
        return (0.01 + 0.02 * torch.rand(size, generator=g, device=device)).to(torch.bfloat16)
    return selfcheck.PackedLayer(w13=words(e, k // 8, 2 * n), w2=words(e, n // 8, k),
                                 s13=scales(e, 2 * n, k // gs), s2=scales(e, k, n // gs), group_size=gs)


@dataclass
class Batch:
    """One call's input: activations and a routing (router logits only for the kernels' shape checks)."""
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    logits: torch.Tensor


def random_batch(shape: Shape, tokens: int, skew: float, seed: int, device: str) -> Batch:
    """Top-k of N(0, 1) scores plus the synthetic router's popularity bias (skew 0: uniform random experts)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, shape.experts, generator=g) + popularity_bias(shape.experts, skew)
    ids = scores.topk(shape.top_k, dim=1).indices
    weights = 0.5 + torch.rand(tokens, shape.top_k, generator=g)
    x = torch.randn(tokens, shape.hidden, generator=g)
    return Batch(x=x.to(device, torch.bfloat16), topk_weights=(weights / weights.sum(1, keepdim=True)).to(device),
                 topk_ids=ids.to(device, torch.int32), logits=scores.to(device, torch.bfloat16))


def expert_bytes(shape: Shape, n: int) -> int:
    """Bytes one expert's INT4 weights and bf16 scales occupy (gate+up [2N, K], down [K, N])."""
    weights = (2 * n * shape.hidden + shape.hidden * n) // 2
    return weights + 2 * (2 * n * shape.hidden + shape.hidden * n) // shape.group_size


def distinct_experts(batch: Batch) -> int:
    return int(batch.topk_ids.unique().numel())


def unpack_int32_along_k(words: torch.Tensor) -> torch.Tensor:
    """[E, K // 8, rows] int32 -> [E, rows, K] int8 in [-8, 7] (inverse of selfcheck.pack_int32_along_k)."""
    nibbles = torch.stack([((words >> (4 * i)) & 0xF).to(torch.int8) for i in range(8)], dim=2)
    return (nibbles.reshape(words.shape[0], -1, words.shape[2]) - 8).transpose(1, 2).contiguous()


def reference_problem(layer: selfcheck.PackedLayer, batch: Batch) -> selfcheck.Problem:
    """The experts `batch` touches, unpacked, with the routing renumbered to them (the reference's input)."""
    touched = batch.topk_ids.unique().long()
    local_ids = torch.searchsorted(touched, batch.topk_ids.long()).to(torch.int32)
    return selfcheck.Problem(x=batch.x, logits=batch.logits, topk_weights=batch.topk_weights, topk_ids=local_ids,
                             q13=unpack_int32_along_k(layer.w13[touched]), s13=layer.s13[touched],
                             q2=unpack_int32_along_k(layer.w2[touched]), s2=layer.s2[touched],
                             group_size=layer.group_size)


def scaled_reference(layer: selfcheck.PackedLayer, batch: Batch) -> torch.Tensor:
    return selfcheck.reference(reference_problem(layer, batch)) * ROUTED_SCALING_FACTOR


def time_calls(calls: list[Callable[[], torch.Tensor]], grid: Grid) -> tuple[float, str]:
    """Median microseconds per call over graph replays (CUDA events); eager when capture fails."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        replay, timing = graph.replay, "cuda_graph"
    except Exception as exc:   # a kernel that cannot be captured is still measured, and said so
        del graph
        torch.cuda.synchronize()
        graph = None

        def replay() -> None:
            for call in calls:
                call()
        timing = f"eager ({type(exc).__name__}: {str(exc)[:200]})"
    for _ in range(grid.warmup_replays):
        replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(grid.replays)]
    for start, end in events:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    per_call_us = statistics.median(s.elapsed_time(e) for s, e in events) * 1000 / len(calls)
    del graph
    return per_call_us, timing


def measure(weights: selfcheck.PreparedWeights, batches: list[Batch], grid: Grid) -> dict:
    """One kernel at one (N, M, routing): first-call time (JIT), then the timed graph."""
    def call_for(b: Batch) -> Callable[[], torch.Tensor]:
        return lambda: selfcheck.run_prepared(weights, b.x, b.topk_weights, b.topk_ids, b.logits,
                                              ROUTED_SCALING_FACTOR)
    calls = [call_for(b) for b in batches]
    started = time.perf_counter()
    for call in calls:
        call()
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    us, timing = time_calls(calls, grid)
    return {"us": round(us, 2), "first_call_s": round(first, 3), "timing": timing}


class Report:
    """The JSON being built, rewritten to `path` after every change."""

    def __init__(self, path: Path, payload: dict):
        self.path, self.payload = path, payload
        self.write()

    def write(self) -> None:
        write_json(self.path, self.payload)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    os.replace(tmp, path)


def start_marlin_prebuild() -> subprocess.Popen:
    """In its own session, so that a timeout can end nvcc with it (an orphaned build slows the next one)."""
    return subprocess.Popen([sys.executable, "-c", MARLIN_PREBUILD], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_prebuild(proc: subprocess.Popen, started: float, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=max(timeout - (time.perf_counter() - started), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"status": "timeout", "seconds": round(time.perf_counter() - started, 1), "tail": out[-2000:]}
    status = "built" if proc.returncode == 0 else f"failed rc={proc.returncode}"
    return {"status": status, "seconds": round(time.perf_counter() - started, 1), "tail": out[-2000:]}


def triton_configs(shape: Shape, n: int, ms: tuple[int, ...]) -> dict[str, dict]:
    """The Triton config SGLang picks per M (its tuned file for this E/N/device if any, else its default)."""
    try:
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import try_get_optimal_moe_config
        selfcheck.ensure_global_server_args()
        w1 = (shape.experts, 2 * n, shape.hidden // 2)
        w2 = (shape.experts, shape.hidden, n // 2)
        return {str(m): dict(try_get_optimal_moe_config(w1, w2, shape.top_k, "int4_w4a16", m,
                                                        block_shape=[0, shape.group_size])) for m in ms}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def measure_kernel(kernel: str, prepared: dict[int, selfcheck.PreparedWeights], shape: Shape, grid: Grid,
                   report: Report, deadline: float) -> None:
    """Every (N, M, routing) row of one kernel, into report.payload['rows'], until the deadline."""
    rows = report.payload["rows"]
    for name, skew in grid.routings:      # uniform first at every N: a deadline cuts the skewed rows first
        for n, weights in prepared.items():
            for m in grid.ms:
                key = f"N={n} M={m} {name}"
                if skew > 0 and m not in grid.skewed_ms:
                    continue
                row = rows.setdefault(key, {"N": n, "M": m, "routing": name, "skew": skew})
                if time.perf_counter() > deadline:
                    report.payload["left_out"].append(f"{kernel} {key}")
                    continue
                batches = [random_batch(shape, m, skew, seed=1000 * i + m, device="cuda")
                           for i in range(grid.calls_for(m))]
                row["distinct_experts"] = statistics.mean(distinct_experts(b) for b in batches)
                row["touched_bytes"] = int(row["distinct_experts"] * expert_bytes(shape, n))
                try:
                    row[kernel] = measure(weights, batches, grid)
                    row[kernel]["GBps"] = round(row["touched_bytes"] / row[kernel]["us"] / 1e3, 1)
                except Exception as exc:   # one failing shape must not cost the others
                    row[kernel] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                add_ratio(row)
                report.write()
    report.write()


def add_ratio(row: dict) -> None:
    t, m = row.get("triton_w4a16", {}).get("us"), row.get("marlin_w4a16", {}).get("us")
    if t and m:
        row["triton_over_marlin"] = round(t / m, 3)


def accuracy(layers: dict, prepared: dict[str, dict], shape: Shape, n: int, m: int) -> dict:
    """Both kernels against the dequantised reference, and against each other, at one shape."""
    if n not in layers:
        return {"skipped": f"N={n} not measured"}
    batch = random_batch(shape, m, 0.0, seed=7, device="cuda")
    ref = scaled_reference(layers[n], batch)
    outs, result = {}, {"N": n, "M": m}
    for kernel, weights in prepared.items():
        try:
            outs[kernel] = selfcheck.run_prepared(weights[n], batch.x, batch.topk_weights, batch.topk_ids,
                                                  batch.logits, ROUTED_SCALING_FACTOR)
            result[kernel] = selfcheck.compare(outs[kernel], ref, selfcheck.DEFAULT_TOLERANCE)
        except Exception as exc:
            result[kernel] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    if len(outs) == 2:
        result["triton_vs_marlin"] = selfcheck.compare(outs["triton_w4a16"], outs["marlin_w4a16"],
                                                       selfcheck.DEFAULT_TOLERANCE)
    return result


def run(args: argparse.Namespace) -> dict:
    shape = TINY if args.tiny else Shape()
    grid = grid_for(args.quick, args.skew, args.tiny)
    payload = {"environment": selfcheck.environment(), "shape": asdict(shape), "grid": asdict(grid),
               "kernels": list(args.kernels), "routed_scaling_factor": ROUTED_SCALING_FACTOR, "rows": {},
               "left_out": [], "budget_s": args.budget_s}
    report = Report(Path(args.out), payload)
    if not torch.cuda.is_available():
        payload["skipped"] = "no CUDA device: the W4A16 MoE kernels are CUDA kernels"
        report.write()
        return payload
    started = time.perf_counter()
    prebuild = start_marlin_prebuild() if "marlin_w4a16" in args.kernels else None
    layers = {n: random_layer(shape, n, "cuda", seed=n) for n in grid.ns}
    payload["triton_configs"] = {str(n): triton_configs(shape, n, grid.ms) for n in grid.ns}
    prepared: dict[str, dict] = {}
    waited, shares = 0.0, [BUDGET_SHARE[k] for k in args.kernels]
    for index, kernel in enumerate(args.kernels):
        if kernel == "marlin_w4a16" and prebuild is not None:
            t0 = time.perf_counter()
            payload["marlin_prebuild"] = wait_prebuild(prebuild, started, args.marlin_build_timeout)
            waited = time.perf_counter() - t0
        t0 = time.perf_counter()
        prep = selfcheck.prepare_marlin if kernel == "marlin_w4a16" else selfcheck.prepare_triton
        prepared[kernel] = {n: prep(layer) for n, layer in layers.items()}
        torch.cuda.synchronize()
        payload.setdefault("prepare_s", {})[kernel] = round(time.perf_counter() - t0, 2)
        deadline = started + waited + args.budget_s * sum(shares[:index + 1]) / sum(shares)
        measure_kernel(kernel, prepared[kernel], shape, grid, report, deadline)
    n, m = (grid.ns[0], 2) if args.tiny else ACCURACY_SHAPE
    payload["accuracy"] = accuracy(layers, prepared, shape, n, m)
    payload["wall_s"] = round(time.perf_counter() - started, 1)
    payload["wall_s_without_marlin_build_wait"] = round(payload["wall_s"] - waited, 1)
    report.write()
    return payload


def table(payload: dict) -> str:
    lines = [f"{'N':>5} {'M':>4} {'routing':>9} {'experts':>7} {'marlin us':>10} {'triton us':>10} "
             f"{'t/m':>6} {'marlin GB/s':>11} {'triton GB/s':>11}"]
    rows = sorted(payload.get("rows", {}).values(), key=lambda r: (r["routing"] != "uniform", -r["N"], r["M"]))
    for row in rows:
        mar, tri = row.get("marlin_w4a16", {}), row.get("triton_w4a16", {})
        lines.append(f"{row['N']:>5} {row['M']:>4} {row['routing']:>9} {row.get('distinct_experts', 0):>7.1f} "
                     f"{mar.get('us', float('nan')):>10.1f} {tri.get('us', float('nan')):>10.1f} "
                     f"{row.get('triton_over_marlin', float('nan')):>6.2f} {mar.get('GBps', float('nan')):>11.1f} "
                     f"{tri.get('GBps', float('nan')):>11.1f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON report (rewritten after every measurement)")
    ap.add_argument("--quick", action="store_true", help=f"M in {QUICK_M}, uniform routing only")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the whole path")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--skew", type=float, default=0.25, help="synthetic-router skew of the second routing; 0: none")
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="wall time from the start, less the wait for Marlin's build, after which no row starts")
    ap.add_argument("--marlin-build-timeout", type=float, default=540.0,
                    help="seconds from the start to wait for Marlin's JIT build")
    ap.add_argument("--prebuild-only", action="store_true",
                    help="only build Marlin's JIT kernels into the cache (e.g. in the background early in a lease)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prebuild_only:
        started = time.perf_counter()
        result = wait_prebuild(start_marlin_prebuild(), started, args.marlin_build_timeout)
        print(json.dumps(result))
        return 0 if result["status"] == "built" else 1
    payload = run(args)
    print(payload.get("skipped") or table(payload))
    if "accuracy" in payload:
        print(json.dumps(payload["accuracy"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
