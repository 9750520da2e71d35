"""One measurement: server -> workload -> records -> summary, with the checks against the baseline. It fills a
Measurement (experiments/tracking/export.py) as it goes and writes nothing to the store: the caller exports what it
has on every way out, so a failed run keeps what it saw."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from rich.console import Console

from experiments.config.views import RunView
from experiments.engines import adapter_for, limits_mismatch
from experiments.engines.auth import auth_headers
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
from experiments.harness.client import RequestSettings, WorkloadRunner, run_interleaved
from experiments.harness.host_watch import HostWatch
from experiments.harness.hostload import host_loaded
from experiments.harness.launch import LaunchSpec
from experiments.harness.partial import keep_partial
from experiments.harness.prepare import PreparedWorkload
from experiments.harness.server import POOL
from experiments.harness.steps import step_excess
from experiments.harness.summary import SloTargets, Summary, add_level_metrics, check_error_share, summarize
from experiments.harness.telemetry import TAG as TELEMETRY_TAG
from experiments.harness.telemetry import LevelTelemetry
from experiments.tracking.export import LIMIT_PARAM, Measurement
from experiments.tracking.records import load_records, run_records
from experiments.tracking.redact import redact_text

if TYPE_CHECKING:
    from mlflow.entities import Run

console = Console(stderr=True)
log = logging.getLogger(__name__)
TIMING_TAG, INTERLEAVED, SEQUENTIAL = "specws.timing", "interleaved", "sequential"


def measure(m: Measurement, v: RunView, target: LaunchSpec | Served, baseline: Run | None,
            prepared: PreparedWorkload, validation: Validation | None, store_client=None) -> None:
    """Measure into `m`; raises on failure with `m` holding what was measured so far. `store_client` reads the
    baseline's records for the agreement checks."""
    arm = Arm(m, v, target, validation)
    m.tags[TIMING_TAG] = SEQUENTIAL
    try:
        arm.start(prepared)
        _check_limits(m.limits, baseline)
        arm.summarize(arm.runner.run(prepared.plan), _slo(v))
        compare_with_baseline(arm, baseline, store_client)
        check_error_share(m.summary, prepared.workload.max_error_share)  # after the numbers are in `m`
    finally:
        arm.close()


def measure_interleaved(arms: tuple[Arm, Arm], prepared: PreparedWorkload) -> None:
    """Option and baseline paired in time: both servers up together, every block of first-seen prompts sent to
    one and then the other in ABBA order (experiments.harness.client.run_interleaved). Fills both arms' summaries;
    the comparison with the baseline comes after the baseline's run has been exported (compare_with_baseline)."""
    for arm in arms:
        arm.start(prepared)
    option, base = arms
    differ = limits_mismatch({k: str(x) for k, x in option.m.limits.items()},
                             {k: str(x) for k, x in base.m.limits.items()})
    if differ:
        raise PairingRefused(f"engine limits of the option's and the baseline's servers differ: {'; '.join(differ)} "
                             "(pin them with limits.* so that both run under the same ones)")
    results = run_interleaved((option.runner, base.runner), prepared.plan)
    for arm, levels in zip(arms, results, strict=True):
        arm.summarize(levels, _slo(arm.v))
    for arm in arms:
        arm.m.tags[TIMING_TAG] = INTERLEAVED


def _slo(v: RunView) -> SloTargets:
    return SloTargets.of(v.workload.slo)


class Arm:
    """One server measured into one Measurement: its server, its workload runner and its telemetry."""

    def __init__(self, m: Measurement, v: RunView, target: LaunchSpec | Served,
                 validation: Validation | None) -> None:
        self.m, self.v, self.target, self.validation = m, v, target, validation
        self.adapter = adapter_for(target.engine)
        self.log_path = m.records_path.parent / f"server-{_server_key(target)}.log"
        self.server = self.runner = self.watch = None
        m.option, m.workload = v.option, v.workload.name
        m.telemetry = self.telemetry = LevelTelemetry.open(_visible_gpus(target))
        m.tags[TELEMETRY_TAG] = self.telemetry.status

    def start(self, prepared: PreparedWorkload) -> None:
        """The server up and healthy, its limits read back, the workload runner ready."""
        m, v = self.m, self.v
        self.server = _server_for(m, v, self.target, self.log_path, prepared)
        served = isinstance(self.target, Served)
        m.limits = self.target.limits if served else self.adapter.effective_limits(self.server.base_url,
                                                                                  self.validation)
        w = prepared.workload
        settings = RequestSettings(w.max_tokens, w.temperature, w.seed, w.request_timeout_s, w.stall_timeout_s,
                                   w.level_timeout_s, w.floor_tok_s, engine_slots=_engine_slots(m.limits))
        launched = self.target if isinstance(self.target, LaunchSpec) else None
        self.watch = HostWatch.open(self.telemetry, self.server, self.target.engine,
                                    launched.python if launched else None, launched.env if launched else None,
                                    v.site.accelerator, v.spec.draft_model, _visible_gpus(self.target), self.log_path)
        self.runner = WorkloadRunner(self.server, self.adapter, v.model.name, settings, prepared.render(),
                                     m.records_path, Arrivals.of(w), self.watch)
        self.runner.label = v.option

    def summarize(self, levels: list, slo: SloTargets) -> None:
        m = self.m
        m.summary = summarize(levels, self.adapter, slo)
        self._note_host(levels)
        add_level_metrics(m.summary, self.telemetry.level_metrics(
            {c: lv["output_tokens"] for c, lv in m.summary.per_level.items()}))
        m.metrics = _measured_metrics(m.summary, None)
        _note_host_load(m, self.v.baseline.loaded_host_share)
        _note_unsteady_steps(m, self.adapter.step_source)

    def _note_host(self, levels: list) -> None:
        """The host's metrics and tags into the run, and a console line for a level whose host changed state."""
        if self.watch is None:
            return
        self.watch.output_tokens({(lv.concurrency, lv.records[0].repetition): float(sum(
            len(r.output_token_ids) for r in lv.records if r.error is None)) for lv in levels if lv.records})
        self.m.summary.metrics.update(self.watch.metrics())
        self.m.tags |= self.watch.tags()
        for level, why in self.watch.changed().items():
            console.print(f"[yellow]{self.v.option}: the host changed state during concurrency {level} ({why}): "
                          "its numbers straddle two host states[/]")

    def close(self) -> None:
        m = self.m
        self.telemetry.close()
        if self.watch is not None:
            m.host, m.host_calibration = self.watch.close()
        if self.runner is not None:
            m.warmup_metrics, m.warmup_failures = self.runner.warmup.metrics(), list(self.runner.warmup.failures)
            if m.summary is None:   # stopped mid-workload: what the records so far measured
                keep_partial(m, self.adapter)
        m.server_log = self.log_path if self.log_path.exists() else getattr(self.server, "log_path", None)
        if isinstance(self.target, LaunchSpec):
            _read_patches(m, self.target)


def compare_with_baseline(arm: Arm, baseline: Run | None, store_client) -> None:
    """The option's speedups against the baseline's stored metrics, and its greedy or sampled agreement with
    the baseline's stored records; then its verdict line on the console."""
    m, v = arm.m, arm.v
    if baseline is not None:
        m.metrics = _measured_metrics(m.summary, baseline)
        m.tags["specws.baseline_run_id"] = baseline.info.run_id
        m.baseline_tok_s = {int(k.removeprefix("output_tok_s_c")): x for k, x in baseline.data.metrics.items()
                            if k.startswith("output_tok_s_c")}
        greedy = arm.runner.settings.temperature == 0.0
        _agreement_check(m, store_client, baseline, arm.server, arm.adapter, v, greedy)
    _report(v, m)


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
        metrics.update(step_excess(metrics, baseline.data.metrics))
    # per level, for the post-run prediction (experiments/analysis/predict.py), which reads them back
    metrics.update({f"spec_drafts_c{c}": float(a.drafts) for c, a in summary.acceptance_per_level.items()})
    return metrics


def _note_host_load(m: Measurement, share: float) -> None:
    loaded = host_loaded(m.summary.per_level, os.cpu_count() or 1, share)
    m.tags[HOST_LOADED_TAG] = str(loaded).lower()
    if loaded:
        busy = m.metrics.get("host_other_cores_busy_max", 0)
        console.print(f"[yellow]{m.option}: other processes kept up to {busy:.1f} cores busy while this run "
                      "measured: not reused as a baseline[/]")


def _note_unsteady_steps(m: Measurement, source: str) -> None:
    """Where the steps come from, and the levels whose step was bimodal or drifted (tag and console)."""
    m.tags["specws.step_source"] = source
    unsteady = [f"c{c} {kind}" for c, lv in sorted(m.summary.per_level.items())
                for kind in ("bimodal", "drifting") if lv.get(f"step_{kind}")]
    if unsteady:
        m.tags["specws.step_unsteady"] = ", ".join(unsteady)
        console.print(f"[yellow]{m.option}: the server-side step did not hold still within a level: "
                      f"{', '.join(unsteady)} (step_p10/p50/p90_ms_c<c>)[/]")


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
    log.info("%s: %s command line: %s", v.option, target.engine, redact_text(" ".join(target.args)))
    console.print(f"[bold]{v.option}[/]: starting {target.engine} (its log: {log_path})")
    s, t0 = v.server, time.monotonic()
    server, reused = POOL.acquire(target, log_path, s.startup_timeout_s, s.port, s.reuse, s.pool_size,
                                  label=v.option)
    console.print(f"[bold]{v.option}[/]: {target.engine} " + ("reused (already up)" if reused else
                                                              f"up in {time.monotonic() - t0:.0f} s"))
    seen = server.visits.seen(measured) if reused and not prepared.workload.reuse_prompts else set()
    if seen:
        console.print(f"the shared server has already served {len(seen)} of this run's prompts: starting a fresh one")
        server, reused = POOL.acquire(target, log_path, s.startup_timeout_s, s.port, False, s.pool_size,
                                      label=v.option)
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
        path, body = adapter.topk_request(ids, v.model.name)
        resp = httpx.post(server.base_url + path, json=body, headers=auth_headers(server.base_url), timeout=120)
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


def _report(v: RunView, m: Measurement) -> None:
    """One line once measured: the verdict block comes after the post-run analysis (its intervals and verdicts)."""
    levels = sorted(m.summary.per_level) if m.summary is not None else []
    rates = " / ".join(f"{m.metrics[f'output_tok_s_c{c}']:.3g}" for c in levels if f"output_tok_s_c{c}" in m.metrics)
    console.print(f"[bold green]{v.option}[/] on {v.workload.name}: measured at c={', '.join(map(str, levels))}"
                  + (f" ({rates} output tok/s)" if rates else "") + "; the verdict follows the analysis")
