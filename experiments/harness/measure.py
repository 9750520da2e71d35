"""One measured MLflow run: server -> workload -> records -> summary -> metrics, then plots and artifacts.
Whatever happens, the run ends with a status (FINISHED / FAILED / KILLED) and keeps what it saw: the metrics are
in the store before any artifact is written, and a failed artifact write fails the run only after that."""
from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console

from experiments.engines import adapter_for, limits_mismatch
from experiments.engines.base import Validation
from experiments.engines.served import Served
from experiments.harness.attached import AttachedServer, check_first_visits
from experiments.harness.baseline import (
    HOST_LOADED_TAG,
    LIMIT_PARAM,
    PairingRefused,
    compare_greedy,
    compare_sampled,
    speedups,
)
from experiments.harness.client import RequestSettings, WorkloadRunner
from experiments.harness.hostload import host_loaded
from experiments.harness.launch import LaunchSpec
from experiments.harness.prepare import PreparedWorkload
from experiments.harness.server import POOL
from experiments.harness.summary import Summary, check_error_share, summarize
from experiments.tracking import plots
from experiments.tracking.records import load_records, run_records
from experiments.tracking.redact import redact_text
from experiments.tracking.store import Metric, log_params
from experiments.tracking.uploads import Uploads

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

console = Console(stderr=True)
PER_LEVEL_CHARTED = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms")


def log_common_artifacts(uploads: Uploads, target: LaunchSpec | Served) -> None:
    """The launch spec (or the running server's own account of itself) and Hydra's folder."""
    if isinstance(target, Served):
        uploads.dict(target.to_dict(), "served_server.json")
    else:
        uploads.dict(target.to_dict(), "launch_spec.json")
    try:
        hydra_dir = Path(HydraConfig.get().runtime.output_dir) / ".hydra"
    except ValueError:  # HydraConfig not set: called outside a Hydra job
        return
    if hydra_dir.exists():
        uploads.folder(hydra_dir, ".hydra")


def measure(client: MlflowClient, run_id: str, cfg: DictConfig, target: LaunchSpec | Served, records_path: Path,
            baseline: Run | None, prepared: PreparedWorkload, validation: Validation | None,
            uploads: Uploads) -> dict[str, float]:
    """Measure into the already created run `run_id`; raises on failure after logging what it has. Artifact
    writes go through `uploads`, which never raises: the caller fails the run with its first failure last."""
    engine = target.engine
    adapter = adapter_for(engine)
    log_path = records_path.parent / f"server-{_server_key(target)}.log"
    server = runner = None
    try:
        server = _server_for(client, run_id, cfg, target, log_path, prepared)
        limits = target.limits if isinstance(target, Served) else adapter.effective_limits(server.base_url, validation)
        _log_limits(client, uploads, run_id, limits, baseline)
        w = prepared.workload
        settings = RequestSettings(w.max_tokens, w.temperature, w.seed, w.request_timeout_s, w.stall_timeout_s,
                                   w.level_timeout_s, w.floor_tok_s, engine_slots=_engine_slots(limits))
        runner = WorkloadRunner(server, adapter, cfg.model.name, settings, prepared.render(), records_path)
        summary = summarize(runner.run(prepared.plan), adapter)
        metrics = _measured_metrics(summary, baseline)
        _log_metrics(client, run_id, metrics, summary)     # first: nothing after this can lose the measurement
        loaded = host_loaded(summary.per_level, os.cpu_count() or 1, float(cfg.baseline.loaded_host_share))
        client.set_tag(run_id, HOST_LOADED_TAG, str(loaded).lower())
        if loaded:
            console.print(f"[yellow]other processes kept up to {metrics.get('host_other_cores_busy_max', 0):.1f} "
                          "cores busy while this run measured: not reused as a baseline[/]")
        if baseline is not None:
            client.set_tag(run_id, "specws.baseline_run_id", baseline.info.run_id)
        _log_plots(uploads, summary, baseline, cfg.option.name)
        if baseline is not None:  # after the measurement is logged: a check that fails must not take it along
            agreement = _agreement_check(client, uploads, run_id, baseline, records_path, server, adapter, cfg,
                                         greedy=w.temperature == 0.0)
            _log_metrics(client, run_id, agreement, None)
            metrics.update(agreement)
        uploads.dict({"metrics": metrics, "per_level": summary.per_level}, "summary.json")
        _report(cfg, metrics)
        check_error_share(summary, w.max_error_share)   # after logging: a failed run keeps its numbers
        return metrics
    finally:
        _log_outputs(client, uploads, run_id, target, runner, server, log_path, records_path)


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
    # per level, for the post-run prediction (experiments/analysis/predict.py), which reads them back
    metrics.update({f"spec_drafts_c{c}": float(a.drafts) for c, a in summary.acceptance_per_level.items()})
    return metrics


def _log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], summary: Summary | None) -> None:
    """The run's metrics in one batch per 1000; per level also as `by_concurrency/<name>` with step =
    concurrency (MLflow's chart of a metric against its step)."""
    now = _now_ms()
    rows = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    if summary is not None:
        rows += [Metric(f"by_concurrency/{k}", float(m[k]), now, int(c)) for c, m in summary.per_level.items()
                 for k in PER_LEVEL_CHARTED if k in m]
    for start in range(0, len(rows), 1000):
        client.log_batch(run_id, metrics=rows[start:start + 1000])


def _log_plots(uploads: Uploads, summary: Summary, baseline: Run | None, option: str) -> None:
    if summary.acceptance is not None:
        uploads.figure(lambda: plots.acceptance_figure(summary.acceptance), "plots/acceptance.png")
        uploads.dict(asdict(summary.acceptance), "acceptance.json")
    base_tok_s = None
    if baseline is not None:
        base_tok_s = {int(k.removeprefix("output_tok_s_c")): v for k, v in baseline.data.metrics.items()
                      if k.startswith("output_tok_s_c")}
    tok_s = {c: m["output_tok_s"] for c, m in summary.per_level.items()}
    uploads.figure(lambda: plots.throughput_vs_concurrency(tok_s, base_tok_s, option),
                   "plots/throughput_vs_concurrency.png")


def _log_outputs(client, uploads: Uploads, run_id: str, target, runner, server, log_path: Path,
                 records_path: Path) -> None:
    """What the run saw besides its metrics, on every way out; never raises (uploads keeps the failures)."""
    if runner is not None:
        uploads.write("warm-up metrics", lambda: _log_warmup(client, uploads, run_id, runner.warmup))
    server_log = log_path if log_path.exists() else getattr(server, "log_path", None)
    if isinstance(target, LaunchSpec):
        uploads.write("sglang_patches.json", lambda: _log_patches(client, run_id, target, server_log))
    if records_path.exists():
        uploads.file(records_path, "records")
    if server_log is not None and server_log.exists():
        uploads.file(server_log, "server")


def _log_warmup(client: MlflowClient, uploads: Uploads, run_id: str, warmup) -> None:
    """Warm-up requests are not measured, but how many failed, and how, is kept (a failing one is a warning)."""
    client.log_batch(run_id, metrics=[Metric(k, v, _now_ms(), 0) for k, v in warmup.metrics().items()])
    if warmup.failures:
        uploads.dict(warmup.failures, "warmup_errors.json")


def _server_for(client, run_id: str, cfg: DictConfig, target: LaunchSpec | Served, log_path: Path,
                prepared: PreparedWorkload):
    """A healthy server: the running one of `server.url`, whose earlier visits must not include this run's
    measured prompts; else one from the pool, where a reused one that has already served one of them is
    replaced by a fresh one (its caches would measure the earlier visits), unless the workload reuses prompts."""
    measured = prepared.measured_ids()
    if isinstance(target, Served):
        server = AttachedServer(target, str(cfg.engine.health_path))
        seen = check_first_visits(server, measured, prepared.workload.reuse_prompts)
        client.set_tag(run_id, "specws.server_url", target.url)
        client.set_tag(run_id, "specws.server_instance", target.instance)
        client.set_tag(run_id, "specws.server_prior_visits", str(seen))
        console.print(f"[bold]{cfg.option.name}[/]: measuring the running {target.engine} {target.version} server "
                      f"at {target.url}")
        return server
    console.print(f"[bold]{cfg.option.name}[/]: starting {target.engine} ({redact_text(' '.join(target.args))})")
    s = cfg.server
    server, reused = POOL.acquire(target, log_path, s.startup_timeout_s, s.port, s.reuse, s.pool_size)
    seen = server.visits.seen(measured) if reused and not prepared.workload.reuse_prompts else set()
    if seen:
        console.print(f"the shared server has already served {len(seen)} of this run's prompts: starting a fresh one")
        server, reused = POOL.acquire(target, log_path, s.startup_timeout_s, s.port, False, s.pool_size)
    client.set_tag(run_id, "specws.server_reused", str(reused))
    client.set_tag(run_id, "specws.port", str(target.port))
    client.set_tag(run_id, "specws.server_pid", str(server.proc.pid))   # the process this runner started
    return server


def _log_limits(client: MlflowClient, uploads: Uploads, run_id: str, limits: dict, baseline: Run | None) -> None:
    """The limits the server really runs with, read back from it; an option is only judged against a baseline
    that ran under the same ones (SGLang lowers max_running_requests by itself in speculative mode)."""
    log_params(client, run_id, {f"{LIMIT_PARAM}{k}": str(v) for k, v in limits.items()})
    uploads.dict(limits, "engine_limits.json")
    if baseline is None:
        return
    base = {k.removeprefix(LIMIT_PARAM): v for k, v in baseline.data.params.items() if k.startswith(LIMIT_PARAM)}
    differ = limits_mismatch({k: str(v) for k, v in limits.items()}, base)
    if differ:
        raise PairingRefused(f"engine limits differ from baseline run {baseline.info.run_id}'s: {'; '.join(differ)} "
                             "(pin them with limits.* so that option and baseline run under the same ones)")


def _agreement_check(client: MlflowClient, uploads: Uploads, run_id: str, baseline: Run, records_path: Path,
                     server, adapter, cfg: DictConfig, greedy: bool) -> dict:
    """Greedy agreement with the baseline (temperature 0), else the distribution check of sampled outputs."""
    base_records = run_records(client, baseline.info.run_id)
    if base_records is None:
        return {}
    records = load_records(records_path)
    if not greedy:
        metrics, detail = compare_sampled(records, base_records)
        uploads.dict(detail, "sampled_check.json")
        return metrics

    def topk(ids: list[int]) -> list[tuple[int, float]]:
        path, body = adapter.topk_request(ids, cfg.model.name)
        resp = httpx.post(server.base_url + path, json=body, timeout=120)
        resp.raise_for_status()
        return adapter.parse_topk(resp.json())

    metrics, rows = compare_greedy(records, base_records, topk, cfg.baseline.near_tie_margin)
    uploads.dict(rows, "greedy_check.json")
    return metrics


def _log_patches(client, run_id: str, spec: LaunchSpec, log_path: Path | None) -> None:
    """What the SGLang patch launcher applied, in which process, and its kernel self-check, read from the
    server log: the `sglang_patches.applied` tag (name@sglang-version) and `sglang_patches.json`."""
    if spec.module != "sglang_patches.launch" or log_path is None or not log_path.exists():
        return
    from sglang_patches.applying import applied_tag, parse_log
    parsed = parse_log(log_path.read_text(errors="replace"))
    client.set_tag(run_id, "sglang_patches.applied", applied_tag(parsed))
    client.log_dict(run_id, parsed, "sglang_patches.json")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _report(cfg: DictConfig, metrics: dict[str, float]) -> None:
    keys = ["output_tok_s", "accept_length", "acceptance_rate", "speedup_vs_baseline",
            "greedy_exact_match", "greedy_near_ties", "greedy_real_divergences", "ttft_p50_ms", "itl_p50_ms"]
    shown = ", ".join(f"{k}={metrics[k]:.3g}" for k in keys if k in metrics)
    console.print(f"[bold green]{cfg.option.name}[/] on {cfg.workload.name}: {shown}")
