"""One measurement: server -> workload -> records -> summary, with the checks against the baseline. It fills a
Measurement (experiments/tracking/export.py) as it goes and writes nothing to the store: the caller exports what it
has on every way out, so a failed run keeps what it saw."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from experiments.config.views import RunView
from experiments.engines import adapter_for, limits_mismatch
from experiments.engines.base import Validation
from experiments.engines.served import Served
from experiments.harness.arrivals import Arrivals
from experiments.harness.attached import AttachedServer, check_first_visits
from experiments.harness.baseline import (
    HOST_LOADED_TAG,
    PairingRefused,
    compare_greedy,
    compare_sampled,
    slo_breaks,
    speedups,
)
from experiments.harness.client import RequestSettings, WorkloadRunner
from experiments.harness.hostload import host_loaded
from experiments.harness.launch import LaunchSpec
from experiments.harness.prepare import PreparedWorkload
from experiments.harness.server import POOL
from experiments.harness.summary import SloTargets, Summary, add_level_metrics, check_error_share, summarize
from experiments.harness.telemetry import TAG as TELEMETRY_TAG
from experiments.harness.telemetry import LevelTelemetry
from experiments.tracking.export import LIMIT_PARAM, Measurement
from experiments.tracking.records import load_records, run_records
from experiments.tracking.redact import redact_text

if TYPE_CHECKING:
    from mlflow.entities import Run

console = Console(stderr=True)


def measure(m: Measurement, cfg: DictConfig, v: RunView, target: LaunchSpec | Served, baseline: Run | None,
            prepared: PreparedWorkload, validation: Validation | None, store_client=None) -> None:
    """Measure into `m`; raises on failure with `m` holding what was measured so far. `store_client` reads the
    baseline's records for the agreement checks. `cfg` is only what the launch needs (experiments.harness.launch);
    everything else is read from the typed views `v`."""
    adapter = adapter_for(target.engine)
    log_path = m.records_path.parent / f"server-{_server_key(target)}.log"
    m.option = v.option
    server = runner = None
    m.telemetry = telemetry = LevelTelemetry.open(_visible_gpus(target))
    m.tags[TELEMETRY_TAG] = telemetry.status
    try:
        server = _server_for(m, v, target, log_path, prepared)
        served = isinstance(target, Served)
        m.limits = target.limits if served else adapter.effective_limits(server.base_url, validation)
        _check_limits(m.limits, baseline)
        w = prepared.workload
        settings = RequestSettings(w.max_tokens, w.temperature, w.seed, w.request_timeout_s, w.stall_timeout_s,
                                   w.level_timeout_s, w.floor_tok_s, engine_slots=_engine_slots(m.limits))
        runner = WorkloadRunner(server, adapter, v.model, settings, prepared.render(), m.records_path,
                                Arrivals.of(w), telemetry)
        m.summary = summarize(runner.run(prepared.plan), adapter,
                              SloTargets.of(OmegaConf.select(cfg, "workload.slo", default=None)))
        add_level_metrics(m.summary, telemetry.level_metrics(
            {c: lv["output_tokens"] for c, lv in m.summary.per_level.items()}))
        m.metrics = _measured_metrics(m.summary, baseline)
        _note_host_load(m, v.baseline.loaded_host_share)
        if baseline is not None:
            m.tags["specws.baseline_run_id"] = baseline.info.run_id
            m.baseline_tok_s = {int(k.removeprefix("output_tok_s_c")): v for k, v in baseline.data.metrics.items()
                                if k.startswith("output_tok_s_c")}
            _agreement_check(m, store_client, baseline, server, adapter, v, greedy=w.temperature == 0.0)
        _report(v, m.metrics)
        check_error_share(m.summary, w.max_error_share)   # after the numbers are in `m`: a failed run keeps them
    finally:
        telemetry.close()
        if runner is not None:
            m.warmup_metrics, m.warmup_failures = runner.warmup.metrics(), list(runner.warmup.failures)
        m.server_log = log_path if log_path.exists() else getattr(server, "log_path", None)
        if isinstance(target, LaunchSpec):
            _read_patches(m, target)


def _visible_gpus(target: LaunchSpec | Served) -> str | None:
    """The GPUs a launched server is given (CUDA_VISIBLE_DEVICES of its environment or of this process); None
    for a running server or no such setting: telemetry then samples every GPU NVML sees."""
    if isinstance(target, Served):
        return None
    return target.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))


def _engine_slots(limits: dict) -> int | None:
    """Requests the server runs at once, as it reported (a level above it queues in the engine)."""
    for key in ("effective_max_running_requests", "max_running_requests", "max_num_seqs"):
        try:
            return int(float(limits[key]))
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _server_key(target: LaunchSpec | Served) -> str:
    return target.key if isinstance(target, LaunchSpec) else "attached"


def _measured_metrics(summary: Summary, baseline: Run | None) -> dict[str, float]:
    metrics = dict(summary.metrics)
    if baseline is not None:
        metrics.update(speedups(metrics, baseline.data.metrics))
        metrics.update(slo_breaks(metrics, baseline.data.metrics))
    # per level, for the post-run prediction (experiments/analysis/predict.py), which reads them back
    metrics.update({f"spec_drafts_c{c}": float(a.drafts) for c, a in summary.acceptance_per_level.items()})
    return metrics


def _note_host_load(m: Measurement, share: float) -> None:
    loaded = host_loaded(m.summary.per_level, os.cpu_count() or 1, share)
    m.tags[HOST_LOADED_TAG] = str(loaded).lower()
    if loaded:
        console.print(f"[yellow]other processes kept up to {m.metrics.get('host_other_cores_busy_max', 0):.1f} "
                      "cores busy while this run measured: not reused as a baseline[/]")


def _server_for(m: Measurement, v: RunView, target: LaunchSpec | Served, log_path: Path,
                prepared: PreparedWorkload):
    """A healthy server: the running one of `server.url`, whose earlier visits must not include this run's
    measured prompts; else one from the pool, where a reused one that has already served one of them is
    replaced by a fresh one (its caches would measure the earlier visits), unless the workload reuses prompts."""
    measured = prepared.measured_ids()
    if isinstance(target, Served):
        server = AttachedServer(target, v.health_path)
        seen = check_first_visits(server, measured, prepared.workload.reuse_prompts)
        m.tags |= {"specws.server_url": target.url, "specws.server_instance": target.instance,
                   "specws.server_prior_visits": str(seen)}
        console.print(f"[bold]{v.option}[/]: measuring the running {target.engine} {target.version} server "
                      f"at {target.url}")
        return server
    console.print(f"[bold]{v.option}[/]: starting {target.engine} ({redact_text(' '.join(target.args))})")
    s = v.server
    server, reused = POOL.acquire(target, log_path, s.startup_timeout_s, s.port, s.reuse, s.pool_size)
    seen = server.visits.seen(measured) if reused and not prepared.workload.reuse_prompts else set()
    if seen:
        console.print(f"the shared server has already served {len(seen)} of this run's prompts: starting a fresh one")
        server, reused = POOL.acquire(target, log_path, s.startup_timeout_s, s.port, False, s.pool_size)
    # the process this runner started
    m.tags |= {"specws.server_reused": str(reused), "specws.port": str(target.port),
               "specws.server_pid": str(server.proc.pid)}
    return server


def _check_limits(limits: dict, baseline: Run | None) -> None:
    """An option is only judged against a baseline that ran under the same limits, read back from both servers
    (SGLang lowers max_running_requests by itself in speculative mode)."""
    if baseline is None:
        return
    base = {k.removeprefix(LIMIT_PARAM): v for k, v in baseline.data.params.items() if k.startswith(LIMIT_PARAM)}
    differ = limits_mismatch({k: str(v) for k, v in limits.items()}, base)
    if differ:
        raise PairingRefused(f"engine limits differ from baseline run {baseline.info.run_id}'s: {'; '.join(differ)} "
                             "(pin them with limits.* so that option and baseline run under the same ones)")


def _agreement_check(m: Measurement, store_client, baseline: Run, server, adapter, v: RunView,
                     greedy: bool) -> None:
    """Greedy agreement with the baseline (temperature 0), else the distribution check of sampled outputs."""
    base_records = run_records(store_client, baseline.info.run_id)
    if base_records is None:
        return
    records = load_records(m.records_path)
    if not greedy:
        metrics, m.checks["sampled_check.json"] = compare_sampled(records, base_records)
        m.metrics.update(metrics)
        return

    def topk(ids: list[int]) -> list[tuple[int, float]]:
        path, body = adapter.topk_request(ids, v.model)
        resp = httpx.post(server.base_url + path, json=body, timeout=120)
        resp.raise_for_status()
        return adapter.parse_topk(resp.json())

    metrics, m.checks["greedy_check.json"] = compare_greedy(records, base_records, topk, v.baseline.near_tie_margin)
    m.metrics.update(metrics)


def _read_patches(m: Measurement, spec: LaunchSpec) -> None:
    """What the SGLang patch launcher applied, in which process, and its kernel self-check, read from the
    server log: the `sglang_patches.applied` tag (name@sglang-version) and `sglang_patches.json`."""
    if spec.module != "sglang_patches.launch" or m.server_log is None or not m.server_log.exists():
        return
    from sglang_patches.applying import applied_tag, parse_log
    m.patches = parse_log(m.server_log.read_text(errors="replace"))
    m.patches_tag = applied_tag(m.patches)


def _report(v: RunView, metrics: dict[str, float]) -> None:
    keys = ["output_tok_s", "accept_length", "acceptance_rate", "speedup_vs_baseline",
            "greedy_exact_match", "greedy_near_ties", "greedy_real_divergences", "ttft_p50_ms", "itl_p50_ms"]
    shown = ", ".join(f"{k}={metrics[k]:.3g}" for k in keys if k in metrics)
    console.print(f"[bold green]{v.option}[/] on {v.workload.name}: {shown}")
