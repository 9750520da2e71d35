"""Per-component share of decode GPU time from a PyTorch profiler trace, side by side with the box's seed profile.

`python -m experiments.box.decode_profile TRACE.trace.json.gz [...] [--json OUT]`

The trace is the chrome-trace JSON SGLang 0.5.14 writes when profiling is asked for over HTTP:
`POST /start_profile {"output_dir": DIR, "num_steps": N, "activities": ["GPU"]}` (then `/stop_profile`, or it
stops by itself after N steps); each TP rank writes `DIR/<time>-TP-<rank>.trace.json.gz` through
torch.profiler's export_chrome_trace (srt/utils/profile_utils.py). GPU kernels are the events with
`"cat": "kernel"` and a duration `dur` in microseconds. Each kernel is put in the first class whose pattern
its name matches (order matters: Marlin's MoE GEMM is MoE before it is a GEMM); the shares are of all kernel
time, so that they compare with BoxProfile's (experiments/analysis/speedup/model.py), which also sum below 1.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

from experiments.analysis.speedup.model import BoxProfile

# (class, pattern) in matching order; names from NCCL, sgl-kernel and SGLang's Triton kernels
KERNEL_CLASSES: list[tuple[str, re.Pattern]] = [
    ("allreduce", re.compile(r"nccl|all_?reduce|cross_device_reduce|one_shot|two_shot", re.I)),
    ("moe", re.compile(r"marlin|fused_moe|moe_align|moe_sum|topk_softmax|grouped_topk|moe_", re.I)),
    ("attention", re.compile(r"_fwd_grouped_kernel_stage|_fwd_kernel_stage|decode_att|mla|flash|"
                             r"attention|fmha", re.I)),
    ("dense", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|matmul|bmm", re.I)),
]
CLASSES = [name for name, _ in KERNEL_CLASSES] + ["other"]


def classify(kernel: str) -> str:
    return next((name for name, pattern in KERNEL_CLASSES if pattern.search(kernel)), "other")


def load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def kernel_events(trace: dict) -> list[dict]:
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def component_times(traces: list[dict]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Microseconds per class over all traces, and the top kernels of each class."""
    per_class: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    per_kernel: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for trace in traces:
        for event in kernel_events(trace):
            cls = classify(event["name"])
            per_class[cls] += float(event.get("dur", 0.0))
            per_kernel[cls][event["name"]] += float(event.get("dur", 0.0))
    top = {cls: dict(sorted(k.items(), key=lambda kv: -kv[1])[:5]) for cls, k in per_kernel.items()}
    return per_class, top


def box_shares(box: BoxProfile | None = None) -> dict[str, float]:
    box = box or BoxProfile()
    shares = {"allreduce": box.share_allreduce, "moe": box.share_moe, "attention": box.share_attention,
              "dense": box.share_dense}
    return {**shares, "other": max(0.0, 1.0 - sum(shares.values()))}


def profile(paths: list[Path]) -> dict:
    """Shares of kernel time per class next to the box's, with the time behind them."""
    times, top = component_times([load_trace(p) for p in paths])
    total = sum(times.values())
    shares = {c: (t / total if total else 0.0) for c, t in times.items()}
    return {"traces": [str(p) for p in paths], "kernel_time_us": total, "time_us": times, "shares": shares,
            "box_shares": box_shares(), "top_kernels": top}


def table(result: dict) -> str:
    rows = ["| component | measured share | box seed share | kernel time ms |", "|---|---|---|---|"]
    for c in CLASSES:
        rows.append(f"| {c} | {result['shares'][c]:.1%} | {result['box_shares'][c]:.1%} | "
                    f"{result['time_us'][c] / 1000:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.box.decode_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    result = profile(a.traces)
    print(table(result))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
