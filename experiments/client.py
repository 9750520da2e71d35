"""Workload client: streams requests at each concurrency level, one JSONL record per finished request."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

try:  # events are parsed and records written in the event loop, between arrivals: orjson is faster than json
    import orjson

    parse_json = orjson.loads

    def dump_json(obj) -> str:
        return orjson.dumps(obj).decode()
except ImportError:  # pragma: no cover - orjson comes with the sglang-cpu extra
    parse_json, dump_json = json.loads, json.dumps

from experiments.engines.base import EngineAdapter
from experiments.prompts import Prompt
from experiments.server import Server


@dataclass
class RequestRecord:
    concurrency: int
    repetition: int
    prompt_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    start_s: float = 0.0                 # since the level started
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)   # arrival of each streamed chunk
    chunk_tokens: list[int] = field(default_factory=list)      # tokens carried by each chunk
    meta: dict | None = None
    error: str | None = None

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    metrics_before: dict | None
    metrics_after: dict | None


class WorkloadRunner:
    def __init__(self, server: Server, adapter: EngineAdapter, model: str, max_tokens: int,
                 temperature: float, timeout_s: float, records_path: Path):
        self.server, self.adapter, self.model = server, adapter, model
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s
        self.records_path = records_path

    def run(self, prompts: list[Prompt], levels: list[int], repetitions: int,
            warmup: int) -> list[LevelResult]:
        return asyncio.run(self._run(prompts, levels, repetitions, warmup))

    async def _run(self, prompts, levels, repetitions, warmup) -> list[LevelResult]:
        # aiohttp, not httpx: its line reader sustains several times the streamed-token rate at a fraction
        # of the CPU (bench/harness_fidelity.py); a large read buffer for SGLang's cumulative events
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
        async with aiohttp.ClientSession(self.server.base_url, timeout=timeout, read_bufsize=2 ** 22,
                                         json_serialize=dump_json,
                                         connector=aiohttp.TCPConnector(limit=max(levels) + 2, ssl=False)) as client:
            for p in prompts[:warmup]:
                await self._unrecorded(client, p)
            results = []
            # rich redraws from its own thread; at 2 Hz its GIL time stays out of the measured arrival times
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), refresh_per_second=2) as progress:
                for level in levels:
                    if warmup and level > 1:
                        await self._warm_level(client, prompts, level)
                    results.append(await self._level(client, progress, prompts, level, repetitions))
            return results

    async def _warm_level(self, client, prompts, level) -> None:
        """One unrecorded batch at this concurrency first: an engine's first batch of a new size can stall on
        one-off work (SGLang on the H200: the first c4 batch waited 0.5 s, which cost A 3x at c4)."""
        await asyncio.gather(*(self._unrecorded(client, prompts[i % len(prompts)]) for i in range(level)))

    async def _unrecorded(self, client, prompt: Prompt) -> None:
        await self._request(client, RequestRecord(0, 0, prompt.id, prompt.token_ids), time.perf_counter())

    async def _level(self, client, progress, prompts, level, repetitions) -> LevelResult:
        jobs = [(rep, p) for rep in range(repetitions) for p in prompts]
        task = progress.add_task(f"concurrency {level}", total=len(jobs))
        before = await self._scrape(client)
        sem = asyncio.Semaphore(level)
        records: list[RequestRecord] = []
        t0 = time.perf_counter()

        async def one(rep: int, prompt: Prompt) -> None:
            async with sem:
                rec = RequestRecord(level, rep, prompt.id, prompt.token_ids)
                await self._request(client, rec, t0)
                records.append(rec)
                with self.records_path.open("a") as f:  # vars(): asdict() deep-copies every list, in the loop
                    f.write(dump_json(vars(rec)) + "\n")
                progress.advance(task)

        work = asyncio.gather(*(one(rep, p) for rep, p in jobs))
        watch = asyncio.create_task(self._watch_server())
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        wall = time.perf_counter() - t0
        if watch in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            watch.result()  # raises EngineDied
        watch.cancel()
        work.result()
        if any(r.error for r in records):  # failed requests may be the first sign of a dying server
            self.server.check_alive(wait_s=2.0)
        after = await self._scrape(client)
        return LevelResult(level, wall, records, before, after)

    async def _watch_server(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.server.check_alive()

    async def _scrape(self, client: aiohttp.ClientSession) -> dict | None:
        try:
            async with client.get("/metrics") as resp:
                text = await resp.text() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None
        return self.adapter.metrics_snapshot(text)

    async def _request(self, client: aiohttp.ClientSession, rec: RequestRecord, t0: float) -> None:
        path, body = self.adapter.stream_request(rec.prompt_token_ids, self.max_tokens,
                                                 self.temperature, self.model)
        start = time.perf_counter()
        rec.start_s = start - t0
        parse_raw, parse_event = self.adapter.parse_raw, self.adapter.parse_event
        try:
            async with client.post(path, json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for raw in resp.content:   # one SSE line at a time
                    now = time.perf_counter() - start   # arrival, before any parsing
                    if not raw.startswith(b"data:"):   # SSE: the field name starts the line
                        raw = raw.strip()
                        if not raw.startswith(b"data:"):
                            continue
                    data = raw[5:].strip()              # one copy of a (cumulative, growing) event
                    if data == b"[DONE]":
                        break
                    # SGLang's events are cumulative: read only their new tail where possible
                    n = len(rec.output_token_ids)
                    delta = parse_raw(data, n) or parse_event(parse_json(data), n)
                    if delta.token_ids:
                        if rec.ttft_s is None:
                            rec.ttft_s = now
                        rec.chunk_times_s.append(now)
                        rec.chunk_tokens.append(len(delta.token_ids))
                        rec.output_token_ids.extend(delta.token_ids)
                        rec.text += delta.text
                    if delta.meta is not None:
                        rec.meta = delta.meta
            rec.e2e_s = time.perf_counter() - start
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # ValueError: JSON, line size
            rec.error = f"{type(exc).__name__}: {exc}"
            # a failed request is often the first sign of a dying server: stop the level then,
            # instead of firing the remaining requests at a closed port
            await asyncio.to_thread(self.server.check_alive, 2.0)


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
