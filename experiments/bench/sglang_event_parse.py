"""CPU cost per SGLang /generate stream event in the workspace client's parse: the whole event (orjson +
SGLangAdapter.parse_event) vs the incremental path (SGLangAdapter.parse_raw: only the new tail of the cumulative
output_ids; the finishing event still parsed whole). Synthetic events shaped like SGLang's (text, output_ids,
meta_info with finish_reason null until the end). No network: this is the parse alone, not
experiments.bench.harness_fidelity.

    .venv/bin/python -m experiments.bench.sglang_event_parse [--tokens 256 1024]
"""
from __future__ import annotations

import argparse
import time

import orjson

from experiments.engines.sglang_engine import SGLangAdapter

WORDS = [f" w{i}" for i in range(1000)]


def stream(n: int) -> list[bytes]:
    ids: list[int] = []
    out = []
    for i in range(n):
        ids.append(1000 + i * 37)
        meta = {"id": "x", "finish_reason": {"type": "length"} if i == n - 1 else None, "prompt_tokens": 8,
                "completion_tokens": i + 1}
        out.append(orjson.dumps({"text": "".join(WORDS[t % 1000] for t in ids), "output_ids": ids, "meta_info": meta}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    a = SGLangAdapter()
    paths = {"whole event": lambda d, k: a.parse_event(orjson.loads(d), k),
             "incremental": lambda d, k: a.parse_raw(d, k) or a.parse_event(orjson.loads(d), k)}
    for n in args.tokens:
        events = stream(n)
        for name, parse in paths.items():
            best = float("inf")
            for _ in range(args.repeats):
                t, got = time.process_time(), []
                for d in events:
                    got += parse(d, len(got)).token_ids
                best = min(best, time.process_time() - t)
            assert got == [1000 + i * 37 for i in range(n)]
            print(f"{n} tokens per request, {name}: {1e6 * best / n:.2f} us CPU per event")


if __name__ == "__main__":
    main()
