"""Harness fidelity: the workspace client (experiments/harness/client.py WorkloadRunner) and SGLang's
`python -m sglang.bench_serving`, side by side against one loopback server that streams tokens on a known
schedule (experiments/bench/loopback.py).

Reported per client and protocol: TTFT and ITL error against the times the server really sent each event
(p50 / p99 of |client - server|, in ms), and the streamed-token rate the client sustained.
Scenarios: `schedule` (first token after 20 ms, then one token every 5 ms, 8 streams) for the timing
error; `rate` (tokens streamed as fast as the server can, 32 streams) for the sustained rate.

`python -m experiments.bench.harness_fidelity [--requests 32] [--tokens 256] [--json out.json]`
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from experiments.bench.loopback import reset, sent_times, start_loopback
from experiments.config.paths import cache_dir
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.client import RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.server import Server
from experiments.harness.workloads.sampling import plan_visits
from experiments.tracking.records import load_records

TOKENIZER = cache_dir() / "models" / "SmolLM2-135M-Instruct"
# bench_serving imports, at module level, HF `datasets` (its MMMU loader) and, through sglang.srt, torchvision,
# tvm_ffi, compressed_tensors, sentencepiece and dill. .venv has sglang installed --no-deps, without them;
# where one is missing a stand-in that only exists to be imported lets bench_serving's own main and request
# code run unchanged (the random-ids dataset and the streaming request functions measured here use none).
BENCH_SERVING = """
import importlib.abc, importlib.machinery, importlib.util, runpy, sys, types

class AnyMeta(type):
    def __getattr__(cls, name): return Anything()

class Anything(metaclass=AnyMeta):
    def __init__(self, *args, **kwargs): pass
    def __call__(self, *args, **kwargs):  # used as a decorator: hand back what it decorates
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Anything()
    def __getattr__(self, name): return Anything()

class StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return AnyMeta(name, (Anything,), {})

class StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots): self.roots = roots
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec): return StandInModule(spec.name)
    def exec_module(self, module): module.__path__ = []

if importlib.util.find_spec("dill") is None:   # custom logit processors pickle at import; plain pickle does
    import pickle
    dill = types.ModuleType("dill")
    dill.__spec__ = importlib.machinery.ModuleSpec("dill", None)
    dill.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    dill.extend = lambda *args, **kwargs: None
    sys.modules["dill"] = dill
STAND_IN = ("datasets", "torchvision", "tvm_ffi", "compressed_tensors", "sentencepiece")
missing = {m for m in STAND_IN if importlib.util.find_spec(m) is None}
if missing:
    sys.meta_path.insert(0, StandIns(missing))
    import transformers.utils as tu  # transformers itself must keep seeing them as absent
    for mod in (tu, tu.import_utils):
        for name in dir(mod):
            if any(name.startswith(f"is_{m}") for m in missing):
                setattr(mod, name, lambda *args, **kwargs: False)
sys.argv = ["sglang.bench_serving", *sys.argv[1:]]
runpy.run_module("sglang.bench_serving", run_name="__main__")
"""
SCENARIOS = {"schedule": {"ttft_ms": 20.0, "itl_ms": 5.0, "concurrency": 8},
             "rate": {"ttft_ms": 0.0, "itl_ms": 0.0, "concurrency": 32}}


def errors(pairs: list[tuple[float, list[float], float, list[float]]]) -> dict[str, float]:
    """pairs: (client ttft, client ITLs, server first send, server gaps) per request, seconds."""
    ttft = np.array([abs(ct - st) for ct, _, st, _ in pairs]) * 1e3
    itl = np.concatenate([np.abs(np.asarray(ci) - np.asarray(si)) for _, ci, _, si in pairs
                          if len(ci) == len(si)] or [np.array([np.nan])]) * 1e3
    aligned = sum(len(ci) == len(si) for _, ci, _, si in pairs)
    return {"ttft_err_p50_ms": float(np.median(ttft)), "ttft_err_p99_ms": float(np.percentile(ttft, 99)),
            "itl_err_p50_ms": float(np.nanmedian(itl)), "itl_err_p99_ms": float(np.nanpercentile(itl, 99)),
            "itl_err_max_ms": float(np.nanmax(itl)), "requests_aligned": aligned, "requests": len(pairs)}


def serial(text: str) -> str | None:
    m = re.search(r"\br(\d+)\|", text)
    return m.group(1) if m else None


def run_workspace_client(server: Server, protocol: str, n: int, tokens: int, conc: int) -> dict:
    adapter = VLLMAdapter() if protocol == "openai" else SGLangAdapter()
    convs, render = fixed_prompts({f"p{i}": [1000 + i, 7, 8, 9] for i in range(n + 1)})
    plan = plan_visits(convs, [conc], 1, 1, 0)   # one warm-up request (not measured), as bench_serving
    reset(server)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.jsonl"
        runner = WorkloadRunner(server, adapter, "loopback", RequestSettings(tokens, 0.0, 0, 120), render, path)
        (level,) = runner.run(plan)
        records = load_records(path)
    sent = {v["prompt"]: v["times"] for v in sent_times(server).values()}
    pairs = []
    for r in records:
        times = sent.get(json.dumps(r["prompt_token_ids"]))
        if times and r["ttft_s"] is not None:
            ct = r["chunk_times_s"]
            pairs.append((r["ttft_s"], list(np.diff(ct)), times[0], list(np.diff(times))))
    out_tokens = sum(len(r["output_token_ids"]) for r in records)
    return {**errors(pairs), "tok_s": out_tokens / level.wall_s, "output_tokens": out_tokens}


def run_bench_serving(server: Server, backend: str, n: int, tokens: int, conc: int) -> dict:
    reset(server)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        cmd = [sys.executable, "-c", BENCH_SERVING, "--backend", backend, "--base-url", server.base_url,
               "--dataset-name", "random-ids", "--random-input-len", "8", "--random-output-len", str(tokens),
               "--random-range-ratio", "1", "--num-prompts", str(n), "--max-concurrency", str(conc),
               "--tokenizer", str(TOKENIZER), "--model", str(TOKENIZER), "--served-model-name", "loopback",
               "--output-file", str(out), "--output-details", "--disable-tqdm", "--warmup-requests", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench_serving {backend} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text().splitlines()[-1])
    # bench_serving keeps no prompt per output; the server numbers requests in its first token ("rN|")
    by_serial = {k: v["times"] for k, v in sent_times(server).items()}
    pairs = []
    for text, ttft, itls in zip(result["generated_texts"], result["ttfts"], result["itls"], strict=True):
        times = by_serial.get(serial(text) or "")
        if times:
            pairs.append((ttft, itls, times[0], list(np.diff(times))))
    return {**errors(pairs), "tok_s": result["output_throughput"], "output_tokens": result["total_output_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    clients = [("workspace client", "openai", run_workspace_client, "openai"),
               ("workspace client", "sglang /generate", run_workspace_client, "sglang"),
               ("sglang.bench_serving", "openai (sglang-oai)", run_bench_serving, "sglang-oai"),
               ("sglang.bench_serving", "sglang /generate", run_bench_serving, "sglang")]
    results = []
    load_before = os.getloadavg()[0]
    for name, sc in SCENARIOS.items():
        server = start_loopback(sc["ttft_ms"], sc["itl_ms"])
        try:
            for client, protocol, fn, arg in clients:
                r = fn(server, arg, args.requests, args.tokens, sc["concurrency"])
                results.append({"scenario": name, "client": client, "protocol": protocol, **sc, **r})
                print(f"{name:>8} | {client:<20} | {protocol:<20} | TTFT err p50/p99 {r['ttft_err_p50_ms']:.3f}/"
                      f"{r['ttft_err_p99_ms']:.3f} ms | ITL err p50/p99 {r['itl_err_p50_ms']:.3f}/"
                      f"{r['itl_err_p99_ms']:.3f} ms | {r['tok_s']:.0f} tok/s | aligned "
                      f"{r['requests_aligned']}/{r['requests']}", flush=True)
        finally:
            server.stop()
    print(f"\n{os.cpu_count()} cores, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print("\n| scenario | client | protocol | TTFT err p50 / p99 ms | ITL err p50 / p99 / max ms | streamed tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['scenario']} | {r['client']} | {r['protocol']} | {r['ttft_err_p50_ms']:.3f} / "
              f"{r['ttft_err_p99_ms']:.3f} | {r['itl_err_p50_ms']:.3f} / {r['itl_err_p99_ms']:.3f} / "
              f"{r['itl_err_max_ms']:.2f} | {r['tok_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
