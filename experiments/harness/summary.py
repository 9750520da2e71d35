"""Per-request records + engine acceptance -> summary metrics (names as logged to MLflow)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from experiments.engines.base import Acceptance, EngineAdapter, merge_acceptance
from experiments.harness.client import LevelResult
from experiments.harness.hostload import combine
from experiments.harness.steps import step_metrics

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SloTargets:
    """`workload.slo`: per-request latency targets in seconds, each None for no target. A request is good when
    it finished and meets every set target (`vllm bench serve --goodput`); a level meets a target when the p99
    of that latency over its requests is within it."""
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    e2e_p99_s: float | None = None

    @classmethod
    def of(cls, node: Mapping | None) -> SloTargets:
        """From the config's `workload.slo` mapping (None or missing keys: no target)."""
        node = node or {}
        return cls(**{f.name: None if node.get(f.name) is None else float(node[f.name]) for f in fields(cls)})

    @property
    def targets(self) -> dict[str, float]:
        """Latency name (ttft, tpot, e2e) -> target seconds, for the targets that are set."""
        return {f.name.removesuffix("_p99_s"): getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


def request_latencies(r) -> dict[str, float | None]:
    """A finished request's TTFT, TPOT and e2e in seconds; TPOT of a one-token answer is 0, as vLLM's goodput
    takes it (vllm/benchmarks/serve.py calculate_metrics)."""
    n = len(r.output_token_ids)
    tpot = (r.e2e_s - r.ttft_s) / (n - 1) if r.ttft_s is not None and n > 1 else 0.0
    return {"ttft": r.ttft_s, "tpot": tpot, "e2e": r.e2e_s}


def meets(r, targets: dict[str, float]) -> bool:
    lat = request_latencies(r)
    return all(lat[name] is not None and lat[name] <= target for name, target in targets.items())


@dataclass
class Summary:
    metrics: dict[str, float] = field(default_factory=dict)
    per_level: dict[int, dict[str, float]] = field(default_factory=dict)
    acceptance: Acceptance | None = None
    acceptance_per_level: dict[int, Acceptance] = field(default_factory=dict)
    errors: int = 0
    requests: int = 0                    # measured requests, failed ones included
    errors_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def error_share(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class TooManyErrors(RuntimeError):
    """More measured requests failed than `workload.max_error_share` allows; raised after the metrics are logged."""


def check_error_share(summary: Summary, max_share: float) -> None:
    """Raise TooManyErrors when the failed share of the measured requests is above `max_share`."""
    if summary.error_share > max_share:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(summary.errors_by_kind.items()))
        raise TooManyErrors(f"{summary.errors} of {summary.requests} requests failed ({summary.error_share:.1%}; "
                            f"{kinds}), above workload.max_error_share={max_share}; the records say why per request")


def _pct(prefix: str, values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {}
    ms = np.asarray(values_s) * 1000.0
    out = {f"{prefix}_p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}
    out[f"{prefix}_mean_ms"] = float(ms.mean())
    return out


def slo_metrics(level: LevelResult, ok: list, m: dict[str, float], slo: SloTargets) -> dict[str, float]:
    """With targets set: goodput (requests per second of the level's wall that met every target; a failed
    request meets none), the share of the level's requests that did, and per target whether the level's p99
    (`m`'s <name>_p99_ms) is within it (a p99 missing for want of requests meets it)."""
    targets = slo.targets
    if not targets:
        return {}
    good = sum(meets(r, targets) for r in ok)
    out = {"goodput_req_s": good / level.wall_s if level.wall_s > 0 else 0.0,
           "slo_share": good / len(level.records) if level.records else 0.0, "slo_good_requests": float(good)}
    for name, target in targets.items():
        p99 = m.get(f"{name}_p99_ms")
        out[f"slo_{name}_met"] = float(p99 is None or p99 / 1000.0 <= target)
    out["slo_met"] = float(all(out[f"slo_{name}_met"] for name in targets))
    return out


def level_metrics(level: LevelResult, slo: SloTargets | None = None) -> dict[str, float]:
    ok = [r for r in level.records if r.error is None and r.e2e_s is not None]
    out_tokens = sum(len(r.output_token_ids) for r in ok)
    m = {"requests": float(len(ok)), "errors": float(len(level.records) - len(ok)),
         "output_tokens": float(out_tokens), "wall_s": level.wall_s,
         "output_tok_s": out_tokens / level.wall_s if level.wall_s > 0 else 0.0,
         "request_s": len(ok) / level.wall_s if level.wall_s > 0 else 0.0}
    m.update(_pct("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]))
    m.update(_pct("itl", [x for r in ok for x in r.itl_s]))   # per streamed chunk, as vllm bench serve
    # per token: each chunk's gap spread over the tokens it carried (sglang.bench_serving's native ITL)
    m.update(_pct("itl_token", [gap / n for r in ok for gap, n in zip(r.itl_s, r.chunk_tokens[1:], strict=False)
                                for _ in range(n)]))
    m.update(_pct("tpot", [(r.e2e_s - r.ttft_s) / (len(r.output_token_ids) - 1)
                           for r in ok if r.ttft_s is not None and len(r.output_token_ids) > 1]))
    m.update(_pct("e2e", [r.e2e_s for r in ok]))
    m["tokens_per_chunk"] = out_tokens / max(1, sum(len(r.chunk_tokens) for r in ok))
    m.update(slo_metrics(level, ok, m, slo or SloTargets()))
    m.update(turn_metrics(level))
    if level.deadline_s is not None:
        m["level_deadline_s"] = level.deadline_s
    if level.host is not None:
        m.update(level.host.metrics())
    return m


def by_concurrency(results: list[LevelResult]) -> list[LevelResult]:
    """One result per concurrency: its repetitions' records together, walls added (each repetition is a
    disjoint slice measured back to back), engine counters from the first one's start to the last one's end,
    the longest slice deadline, the host's load over all of them."""
    grouped: dict[int, list[LevelResult]] = {}
    for r in results:
        grouped.setdefault(r.concurrency, []).append(r)
    return [LevelResult(c, sum(r.wall_s for r in rs), [rec for r in rs for rec in r.records],
                        rs[0].metrics_before, rs[-1].metrics_after, _longest(r.deadline_s for r in rs),
                        combine(r.host for r in rs if r.host is not None)) for c, rs in grouped.items()]


def _longest(deadlines) -> float | None:
    known = [d for d in deadlines if d is not None]
    return max(known) if known else None


def turn_metrics(level: LevelResult) -> dict[str, float]:
    """Multi-turn workloads: per user turn, latency and per-request decode rate (a turn is not a wall-clock
    window of its own: turns of different conversations overlap)."""
    turns = sorted({r.turn for r in level.records})
    if turns == [0]:
        return {}
    out: dict[str, float] = {}
    for t in turns:
        ok = [r for r in level.records if r.turn == t and r.error is None and r.e2e_s]
        if not ok:
            continue
        p = f"turn{t}/"
        out[p + "requests"] = float(len(ok))
        out[p + "request_tok_s"] = sum(len(r.output_token_ids) for r in ok) / sum(r.e2e_s for r in ok)
        out[p + "prompt_tokens_mean"] = float(np.mean([len(r.prompt_token_ids) for r in ok]))
        out.update({p + k: v for k, v in _pct("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]).items()
                    if k.endswith("p50_ms")})
        out[p + "tokens_per_chunk"] = sum(len(r.output_token_ids) for r in ok) / max(
            1, sum(len(r.chunk_tokens) for r in ok))
    return out


def summarize(levels: list[LevelResult], adapter: EngineAdapter, slo: SloTargets | None = None) -> Summary:
    s = Summary()
    kinds: Counter[str] = Counter()
    for level in by_concurrency(levels):
        s.per_level[level.concurrency] = level_metrics(level, slo)
        s.errors += int(s.per_level[level.concurrency]["errors"])
        s.requests += len(level.records)
        kinds.update(r.error_kind or "unknown" for r in level.records if r.error is not None or r.e2e_s is None)
        metas = [r.meta for r in level.records if r.meta]
        s.per_level[level.concurrency].update(step_metrics(level.records, adapter))
        acc = adapter.acceptance(level.metrics_before, level.metrics_after, metas)
        if acc is not None:
            s.acceptance_per_level[level.concurrency] = acc
            # every streamed chunk is one engine step of its request; vLLM counts only steps that
            # carried a draft, so its accept length says nothing about steps where n-gram found no match
            chunks = sum(len(r.chunk_tokens) for r in level.records if r.error is None)
            if chunks:
                s.per_level[level.concurrency]["steps_with_draft"] = min(1.0, acc.drafts / chunks)
    s.acceptance = merge_acceptance(list(s.acceptance_per_level.values()))
    for c, m in s.per_level.items():
        s.metrics.update({f"{k}_c{c}": v for k, v in m.items()})
    single = s.per_level[min(s.per_level)]
    s.metrics.update({k: v for k, v in single.items() if k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms",
                                                                "tpot_p50_ms", "e2e_p50_ms")})
    if s.acceptance is not None:
        s.metrics.update(s.acceptance.as_metrics())
        for c, acc in s.acceptance_per_level.items():
            s.metrics[f"accept_length_c{c}"] = acc.accept_length
    s.metrics.update(_host_metrics(levels, s.per_level))
    s.metrics["errors"] = float(s.errors)
    s.errors_by_kind = dict(kinds)
    s.metrics.update({f"errors_by_kind/{k}": float(n) for k, n in kinds.items()})
    return s


def add_level_metrics(s: Summary, per_level: dict[int, dict[str, float]]) -> None:
    """Metrics measured beside the records (experiments.harness.telemetry) into `s`: per level, and in the run's
    metrics as <name>_c<concurrency>."""
    for c, extra in per_level.items():
        if c in s.per_level:
            s.per_level[c].update(extra)
            s.metrics.update({f"{k}_c{c}": v for k, v in extra.items()})


def _host_metrics(levels: list[LevelResult], per_level: dict[int, dict[str, float]]) -> dict[str, float]:
    """Run-level host load: the busiest level's other processes (host_loaded() reads it) and the machine's CPUs."""
    busy = [m["host_other_cores_busy"] for m in per_level.values() if "host_other_cores_busy" in m]
    cpus = [lv.host.cpus for lv in levels if lv.host is not None]
    return {"host_other_cores_busy_max": max(busy), "host_cpu_count": float(cpus[0])} if busy and cpus else {}
