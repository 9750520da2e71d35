"""When each request of an open-loop level is released: arrival times drawn as `vllm bench serve` draws them
(vLLM 0.32 `vllm/benchmarks/serve.py` `get_request`): gamma-distributed gaps of shape `burstiness` and scale
1 / (rate x burstiness) (burstiness 1: a Poisson process), drawn one per request from numpy's legacy generator
seeded with the seed (as `--seed` seeds `np.random`), added up, then scaled so that the last request arrives at
exactly n / rate; an infinite burstiness gives equal gaps of 1 / rate. The first request arrives one drawn gap
after the level starts. A closed-loop level has no schedule."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np

from experiments.config.views import WorkloadView


def gamma_arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival times (seconds after the level's start, ascending) of `n` requests at `rate` requests/s."""
    if n <= 0:
        return []
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] != 0:
        times = times * ((n / rate) / times[-1])
    return [float(t) for t in times]


@dataclass(frozen=True)
class Arrivals:
    """A run's load: closed loop (each level keeps its concurrency in flight) or open loop at `rate`."""
    kind: str = "closed"             # closed | poisson | gamma
    rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0

    @classmethod
    def of(cls, w: WorkloadView) -> Arrivals:
        if not w.open_loop:
            return cls()
        return cls(w.arrival, w.rate, w.burstiness, w.arrival_seed_used)

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"

    def schedule(self, n: int, repetition: int = 0) -> list[float] | None:
        """The arrival times of a slice of `n` conversations (None: closed loop). Repetition r draws with seed + r,
        so repetition 0 is `vllm bench serve --seed <seed>`'s schedule and the others are new draws; an option and
        its baseline get the same schedules."""
        if not self.open_loop:
            return None
        return gamma_arrivals(n, float(self.rate), self.burstiness, (self.seed + repetition) % 2 ** 32)

    def describe(self) -> dict:
        if not self.open_loop:
            return {"arrival": "closed"}
        return {"arrival": self.kind, "rate": self.rate, "burstiness": self.burstiness, "arrival_seed": self.seed}


CLOSED = Arrivals()


async def arrive(when: float, stop: asyncio.Event) -> None:
    """Wait until `when` (on time.perf_counter()'s clock), or until `stop` is set (the level is given up)."""
    delay = when - time.perf_counter()
    if delay > 0 and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()
