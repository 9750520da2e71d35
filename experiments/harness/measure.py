"""One measured MLflow run: server -> workload -> records -> summary -> metrics, plots, artifacts.
Whatever happens, the run ends with a status (FINISHED / FAILED / KILLED) and keeps what it saw."""
from __future__ import annotations

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
from experiments.harness.baseline import LIMIT_PARAM, PairingRefused, compare_greedy, compare_sampled, speedups
from experiments.harness.client import RequestSettings, WorkloadRunner
from experiments.harness.launch import LaunchSpec
from experiments.harness.prepare import PreparedWorkload
from experiments.harness.server import POOL
from experiments.harness.summary import check_error_share, summarize
from experiments.tracking import plots
from experiments.tracking.records import load_records, run_records
from experiments.tracking.store import Metric, log_params

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

console = Console(stderr=True)


def log_common_artifacts(client: MlflowClient, run_id: str, spec: LaunchSpec) -> None:
    client.log_dict(run_id, spec.to_dict(), "launch_spec.json")
    try:
        hydra_dir = Path(HydraConfig.get().runtime.output_dir) / ".hydra"
        if hydra_dir.exists():
            client.log_artifacts(run_id, str(hydra_dir), ".hydra")
    except ValueError:  # HydraConfig not set: called outside a Hydra job
        pass


def measure(client: MlflowClient, run_id: str, cfg: DictConfig, spec: LaunchSpec, out_dir: Path,
            baseline: Run | None, prepared: PreparedWorkload, validation: Validation) -> dict[str, float]:
    """Measure into the already created run `run_id`; raises on failure after logging what it has."""
    adapter = adapter_for(spec.engine)
    records_path = out_dir / f"records-{run_id}.jsonl"
    log_path = out_dir / f"server-{spec.key}.log"
    server = runner = None
    try:
        console.print(f"[bold]{cfg.option.name}[/]: starting {spec.engine} ({' '.join(spec.args)})")
        server, reused = _server_for(cfg, spec, log_path, prepared)
        client.set_tag(run_id, "specws.server_reused", str(reused))
        client.set_tag(run_id, "specws.port", str(spec.port))
        client.set_tag(run_id, "specws.server_pid", str(server.proc.pid))   # the process this runner started
        limits = adapter.effective_limits(server.base_url, validation)
        _log_limits(client, run_id, limits, baseline)
        w = prepared.workload
        settings = RequestSettings(w.max_tokens, w.temperature, w.seed, w.request_timeout_s, w.stall_timeout_s,
                                   w.level_timeout_s)
        runner = WorkloadRunner(server, adapter, cfg.model.name, settings, prepared.render(), records_path)
        levels = runner.run(prepared.plan)
        summary = summarize(levels, adapter)
        metrics = dict(summary.metrics)
        for c, m in summary.per_level.items():
            for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms"):
                if k in m:  # step = concurrency: MLflow's chart of a metric against its step
                    client.log_metric(run_id, f"by_concurrency/{k}", m[k], step=c)
        if summary.acceptance is not None:
            client.log_figure(run_id, plots.acceptance_figure(summary.acceptance), "plots/acceptance.png")
            client.log_dict(run_id, asdict(summary.acceptance), "acceptance.json")
        base_tok_s = None
        if baseline is not None:
            bm = baseline.data.metrics
            metrics.update(speedups(metrics, bm))
            client.set_tag(run_id, "specws.baseline_run_id", baseline.info.run_id)
            base_tok_s = {int(k.removeprefix("output_tok_s_c")): v for k, v in bm.items()
                          if k.startswith("output_tok_s_c")}
        # per level, for the post-run prediction (experiments/analysis/predict.py), which reads them back
        metrics.update({f"spec_drafts_c{c}": float(a.drafts) for c, a in summary.acceptance_per_level.items()})
        tok_s = {c: m["output_tok_s"] for c, m in summary.per_level.items()}
        client.log_figure(run_id, plots.throughput_vs_concurrency(tok_s, base_tok_s, cfg.option.name),
                          "plots/throughput_vs_concurrency.png")
        _log_summary(client, run_id, metrics, summary)
        if baseline is not None:  # after the measurement is logged: a check that fails must not take it along
            metrics.update(_agreement_check(client, run_id, baseline, records_path, server, adapter, cfg,
                                            greedy=w.temperature == 0.0))
            _log_summary(client, run_id, metrics, summary)
        _report(cfg, metrics)
        check_error_share(summary, w.max_error_share)   # after logging: a failed run keeps its numbers
        return metrics
    finally:
        if runner is not None:
            _log_warmup(client, run_id, runner.warmup)
        _log_patches(client, run_id, spec, log_path if log_path.exists() else server.log_path if server else None)
        if records_path.exists():
            client.log_artifact(run_id, str(records_path), "records")
        if log_path.exists():
            client.log_artifact(run_id, str(log_path), "server")
        elif server is not None and server.log_path.exists():
            client.log_artifact(run_id, str(server.log_path), "server")


def _log_warmup(client: MlflowClient, run_id: str, warmup) -> None:
    """Warm-up requests are not measured, but how many failed, and how, is kept (a failing one is a warning)."""
    client.log_batch(run_id, metrics=[Metric(k, v, _now_ms(), 0) for k, v in warmup.metrics().items()])
    if warmup.failures:
        client.log_dict(run_id, warmup.failures, "warmup_errors.json")


def _log_summary(client: MlflowClient, run_id: str, metrics: dict[str, float], summary) -> None:
    client.log_batch(run_id, metrics=[Metric(k, float(v), _now_ms(), 0) for k, v in metrics.items()])
    client.log_dict(run_id, {"metrics": metrics, "per_level": summary.per_level}, "summary.json")


def _agreement_check(client: MlflowClient, run_id: str, baseline: Run, records_path: Path, server, adapter,
                     cfg: DictConfig, greedy: bool) -> dict:
    """Greedy agreement with the baseline (temperature 0), else the distribution check of sampled outputs."""
    if greedy:
        return _greedy_check(client, run_id, baseline, records_path, server, adapter, cfg)
    return _sampled_check(client, run_id, baseline, records_path)


def _server_for(cfg: DictConfig, spec: LaunchSpec, log_path: Path, prepared: PreparedWorkload):
    """A healthy server; a reused one that has already served one of this run's measured prompts is replaced
    by a fresh one (its caches would measure the earlier visits) unless the workload reuses prompts."""
    s = cfg.server
    server, reused = POOL.acquire(spec, log_path, s.startup_timeout_s, s.port, s.reuse, s.pool_size)
    seen = server.visits.seen(prepared.measured_ids()) if reused and not prepared.workload.reuse_prompts else set()
    if seen:
        console.print(f"the shared server has already served {len(seen)} of this run's prompts: starting a fresh one")
        server, reused = POOL.acquire(spec, log_path, s.startup_timeout_s, s.port, False, s.pool_size)
    return server, reused


def _log_limits(client: MlflowClient, run_id: str, limits: dict, baseline: Run | None) -> None:
    """The limits the server really runs with, read back from it; an option is only judged against a baseline
    that ran under the same ones (SGLang lowers max_running_requests by itself in speculative mode)."""
    log_params(client, run_id, {f"{LIMIT_PARAM}{k}": str(v) for k, v in limits.items()})
    client.log_dict(run_id, limits, "engine_limits.json")
    if baseline is None:
        return
    base = {k.removeprefix(LIMIT_PARAM): v for k, v in baseline.data.params.items() if k.startswith(LIMIT_PARAM)}
    differ = limits_mismatch({k: str(v) for k, v in limits.items()}, base)
    if differ:
        raise PairingRefused(f"engine limits differ from baseline run {baseline.info.run_id}'s: {'; '.join(differ)} "
                             "(pin them with limits.* so that option and baseline run under the same ones)")


def _sampled_check(client: MlflowClient, run_id: str, baseline: Run, records_path: Path) -> dict:
    base_records = run_records(client, baseline.info.run_id)
    if base_records is None:
        return {}
    metrics, detail = compare_sampled(load_records(records_path), base_records)
    client.log_dict(run_id, detail, "sampled_check.json")
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


def _greedy_check(client, run_id, baseline: Run, records_path: Path, server, adapter, cfg) -> dict:
    base_records = run_records(client, baseline.info.run_id)
    if base_records is None:
        return {}

    def topk(ids: list[int]) -> list[tuple[int, float]]:
        path, body = adapter.topk_request(ids, cfg.model.name)
        resp = httpx.post(server.base_url + path, json=body, timeout=120)
        resp.raise_for_status()
        return adapter.parse_topk(resp.json())

    metrics, rows = compare_greedy(load_records(records_path), base_records, topk,
                                   cfg.baseline.near_tie_margin)
    client.log_dict(run_id, rows, "greedy_check.json")
    return metrics


def _now_ms() -> int:
    return int(time.time() * 1000)


def _report(cfg: DictConfig, metrics: dict[str, float]) -> None:
    keys = ["output_tok_s", "accept_length", "acceptance_rate", "speedup_vs_baseline",
            "greedy_exact_match", "greedy_near_ties", "greedy_real_divergences", "ttft_p50_ms", "itl_p50_ms"]
    shown = ", ".join(f"{k}={metrics[k]:.3g}" for k in keys if k in metrics)
    console.print(f"[bold green]{cfg.option.name}[/] on {cfg.workload.name}: {shown}")
