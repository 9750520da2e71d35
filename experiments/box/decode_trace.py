"""A PyTorch profiler trace of SGLang decode steps at chosen concurrencies, for experiments.box.decode_profile.

`python -m experiments.box.decode_trace --model DIR --site h200x8-kimi --out DIR --concurrency 1,128`

One server start (the baseline's command line) and a warm-up; per concurrency, `POST /start_profile`
{"output_dir", "num_steps", "activities": ["GPU"]} (SGLang 0.5.14, srt/entrypoints/http_server.py) while c
requests decode; the profiler stops itself after num_steps forward steps and every TP rank writes
`<out>/c<c>/<time>-TP-<rank>.trace.json.gz`. Prefill steps come first, so the profile starts after them
(`start_step` is left to SGLang: steps are counted from the request, and the warm-up is over by then).
The decoding requests go through the harness's client (`h200_serve.generate_all`); the profile request is plain HTTP.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from experiments.moe.h200_serve import PROMPT_VOCAB, PROMPTS, generate_all, launch_spec, served, with_copies

TRACE_WAIT_S = 300
WARMUP_PROMPTS, WARMUP_TOKENS = 2, 8   # one after another, before the first profile


def profile_pass(server, prompts: list[dict], concurrency: int, max_new_tokens: int, folder: Path,
                 num_steps: int) -> dict:
    """c requests in flight; the profile is asked for once they are decoding."""
    folder.mkdir(parents=True, exist_ok=True)
    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(generate_all, server, batch, concurrency, max_new_tokens)
        time.sleep(2.0)   # past the prefill of this batch
        body = {"output_dir": str(folder.resolve()), "num_steps": num_steps, "activities": ["GPU"]}
        httpx.post(f"{server.base_url}/start_profile", json=body, timeout=60).raise_for_status()
        records, _ = decoding.result()
    deadline = time.time() + TRACE_WAIT_S
    while not list(folder.glob("*.trace.json.gz")) and time.time() < deadline:
        time.sleep(2.0)
    traces = sorted(str(p) for p in folder.glob("*.trace.json.gz"))
    return {"concurrency": concurrency, "num_steps": num_steps, "traces": traces,
            "output_tokens": sum((r.meta or {}).get("completion_tokens") or 0 for r in records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.box.decode_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--model-config", default="kimi_k25_mini")
    p.add_argument("--site", default="h200x8-kimi")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 128])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-steps", type=int, default=20)
    p.add_argument("--override", dest="overrides", action="append", default=[], help="a Hydra override on top")
    a = p.parse_args(argv)
    prompts = with_copies(json.loads(PROMPTS.read_text())["prompts"], 4, PROMPT_VOCAB)
    a.out.mkdir(parents=True, exist_ok=True)
    record: dict = {"site": a.site, "passes": []}
    spec = launch_spec(a, "baseline", {}, [])   # limits sized for the largest concurrency: one server serves all

    def body(server) -> None:
        generate_all(server, prompts[:WARMUP_PROMPTS], 1, WARMUP_TOKENS)
        for c in a.concurrency:
            record["passes"].append(profile_pass(server, prompts, c, a.max_new_tokens, a.out / f"c{c}", a.num_steps))
    served(spec, a.out / "server.log", record, body)
    (a.out / "decode_trace.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {a.out / 'decode_trace.json'}: {[len(x['traces']) for x in record['passes']]} traces")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
