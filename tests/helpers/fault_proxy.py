"""Fault-injecting proxy for the fault suite: an aiohttp server in front of a real engine that forwards every
request and injects the configured fault into the replies of streaming requests (a body with `"stream": true`).
The engine stays real; only the faults are made up.

Faults, set with POST /fault {"kind": ..., options} (`set_fault`); kind `none` passes everything through:
- hang: never answers (no status line, no event)
- http_500: answers HTTP 500 without asking the engine
- error_event: `after` events, then vLLM's error event and `data: [DONE]`
- truncate: `after` events, then the connection cut (`ending: "cut"`) or a clean `data: [DONE]` without the
  finish event (`ending: "done"`)
- null_event: `after` events, then `data: null`, then the rest
- bad_json: `after` events, then a line that is not JSON, then the rest
- trickle: the whole reply, one byte every `every_s` seconds
- delay: the whole reply as it is, after `delay_s` seconds
- pace: the engine's events on a set schedule, buffered as they come: the first event that carries tokens (a
  `choices` entry with `token_ids` or `text`) `first_s` after the request arrived, each later one `every_s` after
  the slot of the one before (the k-th, from 0, at first_s + k * every_s); events without tokens (vLLM's usage
  chunk, `data: [DONE]`) right after the line before them; an event the engine sends after its slot when it comes.
  GET /paced: per paced stream, each token event's `arrived_s` (from the engine), `due_s` (its slot) and `sent_s`,
  in seconds since the request arrived (cleared by POST /fault)
- idle_close: any request (streaming or not) that arrives on a client connection idle for at least `idle_s`
  seconds (default 5) since its last reply ended is answered by closing that connection without a reply, as an
  engine's uvicorn does when its keep-alive timeout (5 s) expires just as the request arrives; a request on a new
  connection, or on one idle for less, passes (`skip` and `times` do not apply)
`skip`: the first `skip` streaming requests after a configuration pass through untouched; `times`: the fault hits
that many streaming requests after those, and the later ones pass (default: all of them).

Rewrites of the JSON replies of other requests, set with POST /rewrite {"path": ..., "set": {dotted key: value}}
(`set_rewrite`; an empty `set` clears it): the engine's own answer with those values replaced, e.g. a running
server's settings on `/server_info` (the query string is not matched).

`python -m tests.helpers.fault_proxy --upstream http://127.0.0.1:8000 --port 8123`, or from Python
`start_fault_proxy(upstream_url)`: a started `experiments.harness.server.Server` (stop it when done).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import aiohttp
import httpx
from aiohttp import web

from experiments.config.paths import ROOT
from experiments.harness.launch import LaunchSpec
from experiments.harness.server import Server

MODULE = "tests.helpers.fault_proxy"
FAULTS = ("none", "hang", "http_500", "error_event", "truncate", "null_event", "bad_json", "trickle", "delay",
          "pace", "idle_close")
ERROR_EVENT = {"error": {"object": "error", "message": "injected fault", "type": "InternalServerError", "code": 500}}
DONE = b"data: [DONE]\n\n"


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.fault: dict = {"kind": "none"}
        self.streams = 0          # streaming requests since the fault was set
        self.rewrites: dict[str, dict] = {}   # path -> {dotted key: value} replaced in its JSON replies
        self.paced: list[list[dict]] = []     # `pace`: per stream, its token events' arrived_s, due_s, sent_s
        self.replied: dict = {}               # client connection (transport) -> when its last reply ended
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=2 ** 26)
        app.router.add_post("/fault", self.set_fault)
        app.router.add_post("/rewrite", self.set_rewrite)
        app.router.add_get("/paced", self.get_paced)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.cleanup_ctx.append(self._session)
        return app

    async def _session(self, app: web.Application):
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), read_bufsize=2 ** 22)
        yield
        await self.session.close()

    async def set_fault(self, request: web.Request) -> web.Response:
        fault = await request.json()
        if fault.get("kind") not in FAULTS:
            return web.json_response({"error": f"unknown fault {fault.get('kind')!r}; known: {FAULTS}"}, status=400)
        self.fault, self.streams, self.paced = fault, 0, []
        return web.json_response(fault)

    async def get_paced(self, request: web.Request) -> web.Response:
        return web.json_response(self.paced)

    async def set_rewrite(self, request: web.Request) -> web.Response:
        rule = await request.json()
        self.rewrites[rule["path"]] = rule.get("set") or {}
        return web.json_response(rule)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        loop, transport = asyncio.get_running_loop(), request.transport
        arrived = loop.time()
        last = self.replied.pop(transport, None)
        self.replied = {t: when for t, when in self.replied.items() if not t.is_closing()}
        if self.fault["kind"] == "idle_close" and last is not None and arrived - last >= float(
                self.fault.get("idle_s", 5.0)):
            transport.close()   # no status line: the client sees its pooled connection closed under the request
            return web.Response(status=499)
        try:
            return await self._forward(request, arrived)
        finally:
            if transport is not None and not transport.is_closing():
                self.replied[transport] = loop.time()

    async def _forward(self, request: web.Request, arrived: float) -> web.StreamResponse:
        body = await request.read()
        streaming = request.method == "POST" and _is_streaming(body)
        fault = self._fault_for(streaming)
        if fault["kind"] == "hang":
            await asyncio.Event().wait()
        if fault["kind"] == "http_500":
            return web.Response(status=500, text="injected fault: http_500")
        if fault["kind"] == "delay":   # then the reply as it is
            await asyncio.sleep(float(fault.get("delay_s", 5.0)))
            fault = {"kind": "none"}
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self.session.request(request.method, self.upstream + request.rel_url.path_qs, data=body,
                                        headers=headers) as up:
            if not streaming or up.status != 200:
                reply = await up.read()
                if self.rewrites.get(request.rel_url.path) and up.status == 200:
                    reply = _rewritten(reply, self.rewrites[request.rel_url.path])
                return web.Response(status=up.status, body=reply, content_type=up.content_type)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if fault["kind"] == "pace":
                await self._pace(up, resp, arrived, float(fault.get("first_s", 1.0)), float(fault.get("every_s", 0.5)))
                return resp
            await self._relay(request, up, resp, fault)
            return resp

    def _fault_for(self, streaming: bool) -> dict:
        if not streaming or self.fault["kind"] == "idle_close":   # idle_close: in `forward`, before any of this
            return {"kind": "none"}
        self.streams += 1
        skip, times = int(self.fault.get("skip", 0)), self.fault.get("times")
        hit = self.streams > skip and (times is None or self.streams <= skip + int(times))
        return self.fault if hit else {"kind": "none"}

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse, resp: web.StreamResponse,
                     fault: dict) -> None:
        """The engine's reply line by line, with `fault` injected after `after` events."""
        kind, after, events = fault["kind"], int(fault.get("after", 2)), 0
        async for line in up.content:
            if kind == "trickle":
                await _trickle(resp, line, float(fault.get("every_s", 1.0)))
                continue
            if line.startswith(b"data:") and events == after and kind != "none":
                if kind == "error_event":
                    await resp.write(b"data: " + json.dumps(ERROR_EVENT).encode() + b"\n\n" + DONE)
                    return
                if kind == "truncate":
                    if fault.get("ending", "cut") == "done":
                        await resp.write(DONE)
                        return
                    request.transport.abort()   # mid-reply: no terminating chunk
                    return
                await resp.write(b"data: null\n\n" if kind == "null_event" else b"data: {not json\n\n")
            events += line.startswith(b"data:")
            await resp.write(line)
        await resp.write_eof()

    async def _pace(self, up: aiohttp.ClientResponse, resp: web.StreamResponse, arrived: float, first_s: float,
                    every_s: float) -> None:
        """The engine's reply with its token events on the schedule (`pace`): read into a queue as it comes, the
        k-th token event written at max(its slot, its arrival), its slot first_s + k * every_s after `arrived`; the
        other lines right after the line before them."""
        loop, lines = asyncio.get_running_loop(), asyncio.Queue()
        log: list[dict] = []
        self.paced.append(log)

        async def read() -> None:
            try:
                async for line in up.content:
                    lines.put_nowait((loop.time(), line))
            finally:
                lines.put_nowait((loop.time(), None))

        reader = asyncio.create_task(read())
        try:
            due = arrived + first_s
            while True:
                came, line = await lines.get()
                if line is None:
                    break
                if _carries_tokens(line):
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    await resp.write(line)
                    sent = loop.time()
                    log.append({"arrived_s": came - arrived, "due_s": due - arrived, "sent_s": sent - arrived})
                    due += every_s
                else:
                    await resp.write(line)
            await reader
        finally:
            reader.cancel()
        await resp.write_eof()


def _carries_tokens(line: bytes) -> bool:
    """An SSE `data:` line whose event's first choice carries token ids or text."""
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return False
    try:
        choices = json.loads(line[5:]).get("choices") or []
    except (ValueError, AttributeError):
        return False
    return bool(choices) and isinstance(choices[0], dict) and bool(choices[0].get("token_ids") or
                                                                   choices[0].get("text"))


async def _trickle(resp: web.StreamResponse, line: bytes, every_s: float) -> None:
    for i in range(len(line)):
        await resp.write(line[i:i + 1])
        await asyncio.sleep(every_s)


def _rewritten(reply: bytes, values: dict) -> bytes:
    """A JSON reply with each dotted key set to its value (missing levels created)."""
    doc = json.loads(reply)
    for dotted, value in values.items():
        node = doc
        for part in dotted.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[dotted.split(".")[-1]] = value
    return json.dumps(doc).encode()


def _is_streaming(body: bytes) -> bool:
    try:
        return bool(json.loads(body or b"{}").get("stream"))
    except (ValueError, AttributeError):
        return False


def start_fault_proxy(upstream: str, log_path: Path | None = None, timeout_s: float = 30.0) -> Server:
    """The proxy in front of `upstream` in its own process group, healthy (it forwards /health), on a free port."""
    pythonpath = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    spec = LaunchSpec(engine="fault_proxy", python=sys.executable, module=MODULE, args=["--upstream", upstream],
                      env={"PYTHONPATH": pythonpath}, health_path="/health")
    server = Server(spec, log_path or Path(tempfile.gettempdir()) / f"specws-fault-proxy-{os.getpid()}.log")
    server.start(timeout_s, health_poll_s=0.2)
    return server


def set_fault(proxy: Server, kind: str, **options) -> None:
    """Inject `kind` (see the module docstring) into the streaming replies from now on."""
    httpx.post(proxy.base_url + "/fault", json={"kind": kind, **options}, timeout=10).raise_for_status()


def paced_streams(proxy: Server) -> list[list[dict]]:
    """`pace`: per paced stream since the fault was set, its token events' arrived_s, due_s and sent_s."""
    reply = httpx.get(proxy.base_url + "/paced", timeout=10)
    reply.raise_for_status()
    return reply.json()


def set_rewrite(proxy: Server, path: str, values: dict) -> None:
    """Replace `values` (dotted keys) in the JSON replies of `path` from now on; {} clears it."""
    httpx.post(proxy.base_url + "/rewrite", json={"path": path, "set": values}, timeout=10).raise_for_status()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args()
    web.run_app(FaultProxy(args.upstream).app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True)


if __name__ == "__main__":
    sys.exit(main())
