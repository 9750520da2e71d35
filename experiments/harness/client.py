"""Workload client: streams requests at each concurrency level, one JSONL record per finished request. Closed loop:
each level keeps its concurrency in flight. Open loop (experiments/harness/arrivals.py): each conversation is
released at its drawn arrival time, with at most the level's concurrency in flight (as vllm bench serve
--max-concurrency); its TTFT and e2e count from the scheduled arrival, so a request held back by the cap (or by a
late event loop) counts its wait."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
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

from experiments.engines.auth import auth_headers
from experiments.engines.base import EngineAdapter, StreamError
from experiments.harness.arrivals import CLOSED, Arrivals, arrive
from experiments.harness.deadlines import (
    SKIPPED_AFTER_STALL,
    LevelDeadline,
    RequestSettings,
    skip_after_hang,
    takes_server_as_hung,
)
from experiments.harness.hostload import HostLoad, HostSampler
from experiments.harness.server import Server
from experiments.harness.workloads.formats import Conversation
from experiments.harness.workloads.sampling import VisitPlan


@dataclass
class RequestRecord:
    concurrency: int
    repetition: int
    prompt_id: str
    prompt_token_ids: list[int]
    category: str = "all"
    turn: int = 0                        # 0-based user turn of a multi-turn conversation
    visit: int = 1                       # how many times this prompt (and turn) reached this server, this one included
    order: int = 0                       # position of this request's start within its level
    seed: int | None = None              # sampling seed (temperature > 0)
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    start_s: float = 0.0                 # when it was sent, since the level started
    sent_unix: float | None = None       # when it was sent, on the wall clock (blocks paired in time, host states)
    scheduled_s: float | None = None     # open loop, first turns: its scheduled arrival, since the level started
    queue_s: float | None = None         # open loop, first turns: sent this long after its scheduled arrival
    ttft_s: float | None = None          # from the send, or (open loop, first turns) from the scheduled arrival
    e2e_s: float | None = None           # likewise, to the end of the stream
    chunk_times_s: list[float] = field(default_factory=list)   # arrival of each streamed chunk, from the same origin
    chunk_tokens: list[int] = field(default_factory=list)      # tokens carried by each chunk
    meta: dict | None = None
    error: str | None = None
    error_kind: str | None = None        # http_<status>, error_event, no_finish, null_event, bad_json, truncated,
                                         # stall, deadline, connection; skipped_after_stall: never sent (after
                                         # a stall or a deadline missed while streaming, the server is hung)

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]


Render = Callable[[Conversation, int, list[str]], list[int]]
# kinds that may mean the server is dying (an error event or a bad reply came from a live one)
SERVER_FAULT_KINDS = frozenset({"stall", "deadline", "truncated", "connection"})
# engines' uvicorn closes idle connections after 5 s (SGLANG_TIMEOUT_KEEP_ALIVE, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a
# request written onto a pooled connection just as the server closes it is lost, so the client drops them first
KEEPALIVE_S = 2.0
__all__ = ["SKIPPED_AFTER_STALL", "LevelDeadline", "LevelResult", "RequestRecord", "RequestSettings",
           "WarmupFailed", "WorkloadRunner", "fixed_prompts", "run_interleaved"]
log = logging.getLogger(__name__)


class WarmupFailed(RuntimeError):
    """Every warm-up request of a stage failed: the server does not answer as it should; nothing was measured."""


@dataclass
class WarmupStats:
    """The unrecorded warm-up requests: how many were sent and how each failed one failed."""
    requests: int = 0
    failures: list[dict] = field(default_factory=list)    # prompt_id, stage, error_kind, error

    def metrics(self) -> dict[str, float]:
        kinds = Counter(f["error_kind"] for f in self.failures)
        return {"warmup_requests": float(self.requests), "warmup_errors": float(len(self.failures)),
                **{f"warmup_errors_by_kind/{k}": float(n) for k, n in kinds.items()}}

    def add(self, stage: str, records: list[RequestRecord]) -> None:
        """Count a stage's records; raise WarmupFailed when all of them failed."""
        self.requests += len(records)
        failed = [r for r in records if r.error is not None]
        for r in failed:
            log.warning("warm-up request %s (%s) failed: %s: %s", r.prompt_id, stage, r.error_kind, r.error)
            self.failures.append({"prompt_id": r.prompt_id, "stage": stage, "error_kind": r.error_kind,
                                  "error": r.error})
        if records and len(failed) == len(records):
            kinds = ", ".join(f"{k}: {n}" for k, n in sorted(Counter(r.error_kind for r in failed).items()))
            raise WarmupFailed(f"all {len(records)} warm-up requests {stage} failed ({kinds}; first: "
                               f"{failed[0].error}): the server does not answer as it should, nothing was measured")


@dataclass
class _Clock:
    """One request's timer: each stream event moves it on by the stall timeout, never past the deadline."""
    loop: asyncio.AbstractEventLoop
    timer: asyncio.Timeout
    deadline: float          # on the loop's clock
    stall_s: float
    events: int = 0

    def event(self) -> None:
        self.events += 1
        self.timer.reschedule(min(self.deadline, self.loop.time() + self.stall_s))


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    metrics_before: dict | None
    metrics_after: dict | None
    deadline_s: float | None = None      # the slice's deadline (workload.level_timeout_s, derived when `auto`)
    host: HostLoad | None = None         # the host's load by other processes over the slice
    arrival: dict | None = None          # open loop: the arrival process (kind, rate, burstiness, seed)
    started_unix: float | None = None    # wall-clock start of the slice (which block ran when, paired in time)


class WorkloadRunner:
    """Runs a visit plan against one server: unrecorded warm-ups, then each (level, repetition) slice at its
    concurrency. A conversation holds its slot for all its turns; each later turn is rendered with the model's
    own answers so far and sent after the previous one finished. In open loop (`arrivals`) a conversation waits
    for its arrival time, then for a slot."""

    def __init__(self, server: Server, adapter: EngineAdapter, model: str, settings: RequestSettings,
                 render: Render, records_path: Path, arrivals: Arrivals = CLOSED, telemetry=None):
        """`telemetry`: started and stopped around each measured slice (experiments.harness.telemetry)."""
        self.server, self.adapter, self.model, self.settings = server, adapter, model, settings
        self.render, self.records_path, self.arrivals = render, records_path, arrivals
        self.telemetry = telemetry
        self.warmup = WarmupStats()
        self.label = ""          # names the server on the progress lines where two are measured in turn

    def run(self, plan: VisitPlan) -> list[LevelResult]:
        """One result per (level, repetition) slice, in the plan's order."""
        return asyncio.run(self._run(plan))

    async def _run(self, plan: VisitPlan) -> list[LevelResult]:
        async with self.session(plan) as client:
            await self._warm_up(client, plan.warmup, "at concurrency 1", concurrent=False)
            results = []
            with level_progress() as progress:
                for level in plan.levels:
                    await self.warm_up_level(client, plan, level)
                    for rep in range(plan.repetitions):
                        results.append(await self._level(client, progress, plan.measured[(level, rep)], level, rep))
            return results

    def session(self, plan: VisitPlan) -> aiohttp.ClientSession:
        """The connection pool to this runner's server, sized for the plan's highest level."""
        # aiohttp, not httpx: its line reader sustains several times the streamed-token rate at a fraction
        # of the CPU (experiments/bench/harness_fidelity.py); a large read buffer for SGLang's cumulative events
        # the request and stall deadlines are the client's own timer (`_request`), which tells them apart
        st = self.settings
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(st.timeout_s, st.stall_timeout_s), sock_read=None)
        return aiohttp.ClientSession(self.server.base_url, timeout=timeout, read_bufsize=2 ** 22,
                                     json_serialize=dump_json, headers=auth_headers(self.server.base_url),
                                     connector=aiohttp.TCPConnector(limit=max(plan.levels) + 2, ssl=False,
                                                                    keepalive_timeout=KEEPALIVE_S))

    async def warm_up_level(self, client, plan: VisitPlan, level: int) -> None:
        # an engine's first batch of a new size can stall on one-off work (SGLang on the H200: the
        # first c4 batch waited 0.5 s, which cost A 3x at c4): one unrecorded batch first
        await self._warm_up(client, plan.level_warmup.get(level) or [], f"before concurrency {level}", concurrent=True)

    async def _warm_up(self, client, convs: list[Conversation], stage: str, concurrent: bool) -> None:
        """Unrecorded requests of warm-up conversations (never measured), one after another or all at once;
        their errors are counted in `self.warmup`. After one takes the server as hung, the rest are not sent."""
        records: list[RequestRecord] = []
        hung: list[RequestRecord] = []

        async def one(conv: Conversation) -> None:
            rec = self._record(conv, 0, 0, 0, [], sent=not hung)
            await self._send_unless_hung(client, rec, time.perf_counter(), hung)
            records.append(rec)

        if concurrent:
            await asyncio.gather(*(one(conv) for conv in convs))
        else:
            for conv in convs:
                await one(conv)
        self.warmup.add(stage, records)

    async def _send_unless_hung(self, client, rec: RequestRecord, t0: float, hung: list[RequestRecord]) -> None:
        """Send `rec`, unless a request of the same stage has taken the server as hung (`hung` holds it: a stall,
        or a deadline missed while streaming); `rec` is then recorded as skipped. One that does now joins `hung`."""
        if hung:
            skip_after_hang(rec, hung[0], self.settings)
            return
        if await self._request(client, rec, t0):
            hung.append(rec)

    def _record(self, conv: Conversation, level: int, rep: int, turn: int, answers: list[str],
                sent: bool = True) -> RequestRecord:
        ids = self.render(conv, turn, answers)
        visit = self.server.visits.count(conv.id, turn) if sent else 0
        return RequestRecord(level, rep, conv.id, ids, category=conv.category, turn=turn, visit=visit,
                             seed=self.settings.seed_for(conv.id, turn))

    async def _level(self, client, progress, convs: list[Conversation], level: int, rep: int) -> LevelResult:
        total = sum(c.num_turns for c in convs)
        task = progress.add_task(f"{self.label} concurrency {level}".strip() + (f" block {rep}" if rep else ""),
                                 total=total)
        before = await self._scrape(client)
        sem = asyncio.Semaphore(level)
        records: list[RequestRecord] = []
        started = itertools.count()
        hung: list[RequestRecord] = []   # the request that took the server as hung: the rest are not sent
        schedule = self.arrivals.schedule(len(convs), rep)
        deadline = self.settings.level_deadline_s([c.num_turns for c in convs], level)
        if schedule and deadline is not None:
            deadline += schedule[-1]   # a slice cannot end before its last arrival
        log.info("concurrency %d repetition %d: level deadline %s", level, rep,
                 "none" if deadline is None else f"{deadline:.0f} s")
        stop = asyncio.Event()   # the server is taken as hung: requests still to arrive are not waited for
        sampler = HostSampler.start(served_by=self.server.local_processes())
        if self.telemetry is not None:
            self.telemetry.start(level, rep)
        t0, started_unix = time.perf_counter(), time.time()

        async def conversation(conv: Conversation, at: float | None) -> None:
            if at is not None:
                await arrive(t0 + at, stop)
            async with sem:
                answers: list[str] = []
                for turn in range(conv.num_turns):
                    rec = self._record(conv, level, rep, turn, answers, sent=not hung)
                    rec.order = next(started)
                    if at is not None and turn == 0:
                        rec.scheduled_s = at
                    await self._send_unless_hung(client, rec, t0, hung)
                    if hung:
                        stop.set()
                    records.append(rec)
                    with self.records_path.open("a") as f:  # vars(): asdict() deep-copies every list, in the loop
                        f.write(dump_json(vars(rec)) + "\n")
                    progress.advance(task)
                    if rec.error is not None:
                        progress.advance(task, conv.num_turns - turn - 1)
                        return
                    answers.append(rec.text)

        work = asyncio.gather(*(conversation(c, None if schedule is None else schedule[i])
                                for i, c in enumerate(convs)))
        await self._await_level(work, level, rep, records, total, deadline)
        wall = time.perf_counter() - t0
        if self.telemetry is not None:
            self.telemetry.stop()
        host = sampler.stop()
        if any(r.error_kind in SERVER_FAULT_KINDS for r in records):  # the first sign of a dying server?
            self.server.check_alive(wait_s=2.0)
        after = await self._scrape(client)
        arrival = self.arrivals.describe() if schedule is not None else None
        return LevelResult(level, wall, records, before, after, deadline, host, arrival, started_unix)

    async def _await_level(self, work: asyncio.Future, level: int, rep: int, records: list[RequestRecord],
                           total: int, limit: float | None) -> None:
        """The level's requests, stopped early by a dying server (EngineDied) or the level deadline `limit`
        (LevelDeadline); the requests still running then are cancelled and leave no record."""
        watch = asyncio.create_task(self._watch_server())
        done, _ = await asyncio.wait({work, watch}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        watch.cancel()
        if watch in done:
            watch.result()  # raises EngineDied
        if not done:
            raise LevelDeadline(f"concurrency {level} repetition {rep} ran past its deadline (workload.level_timeout_s="
                                f"{self.settings.describe_level_timeout(limit)}) with {len(records)} of {total} "
                                f"requests done; their records are in {self.records_path}")
        work.result()

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

    async def _request(self, client: aiohttp.ClientSession, rec: RequestRecord, t0: float) -> bool:
        """One streamed request into `rec`; a failure sets its `error` and `error_kind` and never raises.
        True when the failure takes the server as hung (a stall, a deadline missed while streaming)."""
        st = self.settings
        path, body = self.adapter.stream_request(rec.prompt_token_ids, st.max_tokens, st.temperature, self.model,
                                                 seed=rec.seed)
        start = time.perf_counter()
        rec.start_s, rec.sent_unix = start - t0, time.time()
        origin = start   # of TTFT, e2e and the chunk times: the send, or the scheduled arrival in open loop
        if rec.scheduled_s is not None:
            origin = t0 + rec.scheduled_s
            rec.queue_s = start - origin
        loop = asyncio.get_running_loop()
        deadline = loop.time() + st.timeout_s
        clock = _Clock(loop, asyncio.timeout_at(min(deadline, loop.time() + st.stall_timeout_s)), deadline,
                       st.stall_timeout_s)
        timer = clock.timer
        try:
            async with timer:
                await self._stream(client, path, body, rec, origin, clock)
            rec.e2e_s = time.perf_counter() - origin
            return False
        except StreamError as exc:
            rec.error_kind, rec.error = exc.kind, str(exc)
        except TimeoutError as exc:
            if not timer.expired():   # aiohttp's connect timeout
                rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"
            elif timer.when() >= deadline:
                rec.error_kind, rec.error = "deadline", (f"not done after request_timeout_s={st.timeout_s} s "
                                                         f"({clock.events} stream events in)")
            else:
                rec.error_kind, rec.error = "stall", f"no stream event for stall_timeout_s={st.stall_timeout_s} s"
        except aiohttp.ClientPayloadError as exc:   # the connection closed inside the reply
            rec.error_kind, rec.error = "truncated", f"{type(exc).__name__}: {exc}"
        except aiohttp.ClientError as exc:
            rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"
        except ValueError as exc:   # aiohttp: a line over the read buffer
            rec.error_kind, rec.error = "bad_json", f"{type(exc).__name__}: {exc}"
        if rec.error_kind in SERVER_FAULT_KINDS:
            # a failed request is often the first sign of a dying server: stop the level then,
            # instead of firing the remaining requests at a closed port
            await asyncio.to_thread(self.server.check_alive, 2.0)
        return takes_server_as_hung(rec, clock.events)

    async def _stream(self, client: aiohttp.ClientSession, path: str, body: dict, rec: RequestRecord, origin: float,
                      clock: _Clock) -> None:
        """Reads one streamed reply into `rec`, its times from `origin`; each event moves `clock` on by the stall
        timeout, never past the request's deadline. Raises StreamError for a reply the request fails on."""
        parse_raw, parse_event = self.adapter.parse_raw, self.adapter.parse_event
        finished = False
        async with client.post(path, json=body) as resp:
            if resp.status != 200:
                raise StreamError(f"http_{resp.status}", f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:   # one SSE line at a time
                now = time.perf_counter() - origin   # arrival, before any parsing
                complete = raw.endswith(b"\n")
                if not raw.startswith(b"data:"):   # SSE: the field name starts the line
                    raw = raw.strip()
                    if not raw.startswith(b"data:"):
                        continue
                clock.event()
                data = raw[5:].strip()              # one copy of a (cumulative, growing) event
                if data == b"[DONE]":
                    break
                if not complete:
                    raise StreamError("truncated", f"the stream ended inside an event: {data[:200]!r}")
                # SGLang's events are cumulative: read only their new tail where possible
                n = len(rec.output_token_ids)
                try:
                    delta = parse_raw(data, n) or parse_event(parse_json(data), n)
                except StreamError:
                    raise
                except (ValueError, TypeError, KeyError, AttributeError) as exc:
                    raise StreamError("bad_json", f"unreadable event ({type(exc).__name__}): {data[:200]!r}") from None
                if delta.token_ids:
                    if rec.ttft_s is None:
                        rec.ttft_s = now
                    rec.chunk_times_s.append(now)
                    rec.chunk_tokens.append(len(delta.token_ids))
                    rec.output_token_ids.extend(delta.token_ids)
                    rec.text += delta.text
                if delta.meta is not None:
                    rec.meta = delta.meta
                finished = finished or delta.finished
        if not finished:
            raise StreamError("no_finish", f"the stream ended after {len(rec.output_token_ids)} tokens without a "
                                           "finish event")


def level_progress() -> Progress:
    # rich redraws from its own thread; at 2 Hz its GIL time stays out of the measured arrival times. Into a log
    # (not a terminal) no bar: the verdict block is what the log ends with
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), refresh_per_second=2)
    progress.disable = not progress.console.is_terminal
    return progress


def interleaved_order(level_index: int, rep: int, repetitions: int) -> tuple[int, int]:
    """Which runner goes first in a block pair: alternating from one block to the next over the whole run
    (0 1 | 1 0 | 0 1 | ...: ABBA), so that a drift of the host's speed charges both arms alike."""
    k = level_index * repetitions + rep
    return (0, 1) if k % 2 == 0 else (1, 0)


def run_interleaved(runners: tuple[WorkloadRunner, WorkloadRunner], plan: VisitPlan,
                    between: Callable[[int, int, int], None] | None = None) -> tuple[list[LevelResult], ...]:
    """The same plan on two servers that are up together, paired in time: both warm up, then every block (a
    (level, repetition) slice of first-seen prompts) goes to one server and then to the other, in ABBA order. Each
    server sees each prompt once. `between(level, rep, position)`, where given, runs before each block of a pair
    (position 0, 1) and after the pair (2); the host is probed around every slice by each runner's own telemetry
    (harness/host_watch.py). One result list per runner, in the plan's order."""
    return asyncio.run(_interleaved(runners, plan, between))


async def _interleaved(runners: tuple[WorkloadRunner, WorkloadRunner], plan: VisitPlan,
                       between: Callable[[int, int, int], None] | None) -> tuple[list[LevelResult], ...]:
    results: tuple[list[LevelResult], list[LevelResult]] = ([], [])
    async with runners[0].session(plan) as c0, runners[1].session(plan) as c1:
        clients = (c0, c1)
        for runner, client in zip(runners, clients, strict=True):
            await runner._warm_up(client, plan.warmup, "at concurrency 1", concurrent=False)
        with level_progress() as progress:
            for i, level in enumerate(plan.levels):
                for runner, client in zip(runners, clients, strict=True):
                    await runner.warm_up_level(client, plan, level)
                for rep in range(plan.repetitions):
                    for position, which in enumerate(interleaved_order(i, rep, plan.repetitions)):
                        if between is not None:
                            await asyncio.to_thread(between, level, rep, position)
                        result = await runners[which]._level(clients[which], progress, plan.measured[(level, rep)],
                                                             level, rep)
                        results[which].append(result)
                    if between is not None:
                        await asyncio.to_thread(between, level, rep, 2)
    return results


def fixed_prompts(token_ids: dict[str, list[int]], category: str = "all") -> tuple[list[Conversation], Render]:
    """Prompts given as token ids (benchmarks, tests): one-turn conversations and the render that sends them."""
    convs = [Conversation(pid, category, (), (), "", "given") for pid in token_ids]
    return convs, lambda conv, turn, answers: list(token_ids[conv.id])
