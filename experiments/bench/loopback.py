"""Loopback token server for the harness tests and the fidelity benchmark: streams tokens on a known schedule
over the two protocols the workspace's clients speak, and records when it really sent each event.

- POST /v1/completions (OpenAI completions, vLLM-style `token_ids` per choice), POST /generate (SGLang
  native SSE, cumulative `text` / `output_ids` / `meta_info.completion_tokens`)
- schedule: first token `ttft_ms` after the request arrives, then one event of `tokens_per_event` tokens
  every `itl_ms`, each sent at its absolute deadline (no drift); itl_ms = 0 streams as fast as it can
- GET /v1/models, /health, /get_server_info, POST /flush_cache: what bench_serving probes
- GET /sent: per request serial, its prompt and the seconds from arrival to each event's send; the serial
  also opens the first token's text (" r<serial>|") so clients that keep no prompt can be matched

`python -m experiments.bench.loopback --port 8123 --ttft-ms 20 --itl-ms 5`, or from Python
`start_loopback(ttft_ms, itl_ms)`: a started `experiments.harness.server.Server` (stop it when done).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from aiohttp import web

from experiments.config.paths import ROOT
from experiments.harness.launch import LaunchSpec
from experiments.harness.server import Server

MODULE = "experiments.bench.loopback"
WORDS = [f" w{i}" for i in range(1000)]


def prompt_key(body: dict) -> str:
    prompt = body.get("prompt", body.get("input_ids", body.get("text")))
    return json.dumps(prompt)[:2000]


class LoopbackServer:
    def __init__(self, ttft_ms: float, itl_ms: float, tokens_per_event: int = 1, served_model_name: str = "loopback"):
        self.ttft_s, self.itl_s, self.per_event = ttft_ms / 1000, itl_ms / 1000, tokens_per_event
        self.served_model_name = served_model_name
        self.sent: dict[str, dict] = {}
        self.serial = 0
        self.slowdown = 1.0      # every step takes this many times itl_ms (POST /slowdown: a host that changed state)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": self.served_model_name}]}))
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        app.router.add_get("/get_server_info", lambda r: web.json_response({}))
        app.router.add_post("/flush_cache", lambda r: web.Response(text="ok"))
        app.router.add_get("/sent", lambda r: web.json_response(self.sent))
        app.router.add_post("/reset", self.reset)
        app.router.add_post("/slowdown", self.set_slowdown)
        return app

    async def set_slowdown(self, request: web.Request) -> web.Response:
        self.slowdown = float((await request.json())["factor"])
        return web.Response(text="ok")

    async def reset(self, request: web.Request) -> web.Response:
        self.sent.clear()
        return web.Response(text="ok")

    async def _stream(self, request: web.Request, body: dict, n_tokens: int, event) -> web.StreamResponse:
        arrived = time.perf_counter()
        key = prompt_key(body)
        self.serial += 1
        serial = self.serial
        tag = f" r{serial}|"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        times: list[float] = []
        produced, i = 0, 0
        deadline = arrived + self.ttft_s
        while produced < n_tokens:
            if i:
                deadline += self.itl_s * self.slowdown
            delay = deadline - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            count = min(self.per_event, n_tokens - produced)
            ids = list(range(produced, produced + count))
            produced += count
            payload = event(ids, produced, produced >= n_tokens, tag if i == 0 else "")
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            times.append(time.perf_counter() - arrived)
            i += 1
        self.sent[str(serial)] = {"prompt": key, "times": times}
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)

        def event(ids, produced, last, tag):
            return {"id": "cmpl-loopback", "object": "text_completion", "model": "loopback",
                    "choices": [{"index": 0, "text": tag + "".join(WORDS[t % 1000] for t in ids), "token_ids": ids,
                                 "finish_reason": "length" if last else None}],
                    "usage": {"completion_tokens": produced} if last else None}
        return await self._stream(request, body, n, event)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 16)
        text: list[str] = []
        out_ids: list[int] = []

        def event(ids, produced, last, tag):
            text.append(tag)
            text.extend(WORDS[t % 1000] for t in ids)
            out_ids.extend(ids)
            return {"text": "".join(text), "output_ids": list(out_ids),
                    "meta_info": {"completion_tokens": produced, "prompt_tokens": 8,
                                  "finish_reason": {"type": "length"} if last else None}}
        return await self._stream(request, body, n, event)


def start_loopback(ttft_ms: float, itl_ms: float, tokens_per_event: int = 1, log_path: Path | None = None,
                   timeout_s: float = 30.0) -> Server:
    """The loopback server in its own process group, healthy, on a free port; its log appended to one file per
    calling process in the temporary folder unless `log_path` is given."""
    pythonpath = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    spec = LaunchSpec(engine="loopback", python=sys.executable, module=MODULE,
                      args=["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--tokens-per-event",
                            str(tokens_per_event)], env={"PYTHONPATH": pythonpath}, health_path="/health")
    server = Server(spec, log_path or Path(tempfile.gettempdir()) / f"specws-loopback-{os.getpid()}.log")
    server.start(timeout_s, health_poll_s=0.1)
    return server


def sent_times(server: Server) -> dict[str, dict]:
    """Per request serial: its prompt and the seconds from arrival to each event's send."""
    return httpx.get(server.base_url + "/sent", timeout=30).json()


def slow_down(server: Server, factor: float) -> None:
    """Every later step takes `factor` times the server's itl_ms (1: back to its own speed)."""
    httpx.post(server.base_url + "/slowdown", json={"factor": factor}, timeout=10).raise_for_status()


def reset(server: Server) -> None:
    """Forget the requests sent so far."""
    httpx.post(server.base_url + "/reset", timeout=10).raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--tokens-per-event", type=int, default=1)
    ap.add_argument("--served-model-name", default="loopback")   # what /v1/models lists
    args = ap.parse_args()
    server = LoopbackServer(args.ttft_ms, args.itl_ms, args.tokens_per_event, args.served_model_name)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
