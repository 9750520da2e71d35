"""A measurement as the harness hands it over, and its exporter: everything one measured run saw, written to the
run's store (MLflow or the offline store) in one order -- metrics first, then tags and params, then artifacts
through Uploads, which never raise. So a failing artifact write or a failing check never loses the numbers."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from experiments.tracking import plots
from experiments.tracking.store import Metric, log_params
from experiments.tracking.uploads import Uploads

PER_LEVEL_CHARTED = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms", "goodput_req_s", "slo_share",
                     "energy_per_token_j", "gpu_power_w_mean", "gpu_util_pct_mean")
LIMIT_PARAM = "limits.effective."   # params of the limits a server reported running with


@dataclass
class Measurement:
    """What one measured run saw, filled in as it goes (a failed run hands over what it has)."""
    records_path: Path
    option: str = ""
    workload: str = ""
    tags: dict[str, str] = field(default_factory=dict)          # the server: reused, port, pid / url, instance
    limits: dict[str, Any] | None = None                        # read back from the server
    summary: Any = None                                         # harness.summary.Summary
    metrics: dict[str, float] = field(default_factory=dict)     # the run's, speedups and checks included
    checks: dict[str, Any] = field(default_factory=dict)        # artifact name -> greedy / sampled check detail
    warmup_metrics: dict[str, float] = field(default_factory=dict)
    warmup_failures: list[dict] = field(default_factory=list)
    patches: dict | None = None                                 # what the SGLang patch launcher applied
    patches_tag: str | None = None
    server_log: Path | None = None
    baseline_tok_s: dict[int, float] | None = None              # the baseline's per level, for the plot
    telemetry: Any = None                                       # harness.telemetry.LevelTelemetry
    host: dict | None = None              # harness.fingerprint.HostRecord.to_dict(): host.json, its summary as tags
    host_calibration: dict | None = None  # harness.calibration.HostCalibration.to_dict(): host_calibration.json


def export_inputs(uploads: Uploads, launch: dict, name: str) -> None:
    """What a run was given: its launch spec (or a running server's own account of itself) as `name`, and the
    Hydra job's folder (composed config, overrides)."""
    uploads.dict(launch, name)
    try:
        hydra_dir = Path(HydraConfig.get().runtime.output_dir) / ".hydra"
    except ValueError:  # HydraConfig not set: called outside a Hydra job
        return
    if hydra_dir.exists():
        uploads.folder(hydra_dir, ".hydra")


def export(client, run_id: str, m: Measurement, uploads: Uploads) -> None:
    """Write `m` into run `run_id`: metrics, tags and limits go to the store first; plots, summaries, the records
    and the server log are artifacts, each tried on its own (a failure is kept in `uploads`)."""
    _log_metrics(client, run_id, {**m.metrics, **m.warmup_metrics}, m.summary)
    host_tags = {f"host.{k}": v for k, v in ((m.host or {}).get("summary") or {}).items()}
    for key, value in {**host_tags, **m.tags}.items():
        client.set_tag(run_id, key, value)
    if m.limits is not None:
        log_params(client, run_id, {f"{LIMIT_PARAM}{k}": str(v) for k, v in m.limits.items()})
        uploads.dict(m.limits, "engine_limits.json")
    if m.summary is not None:
        _log_plots(uploads, m)
        uploads.dict({"metrics": m.metrics, "per_level": m.summary.per_level}, "summary.json")
    for name, detail in m.checks.items():
        uploads.dict(detail, name)
    if m.warmup_failures:
        uploads.dict(m.warmup_failures, "warmup_errors.json")
    if m.patches is not None:
        uploads.write("sglang_patches.applied", lambda: client.set_tag(run_id, "sglang_patches.applied", m.patches_tag))
        uploads.dict(m.patches, "sglang_patches.json")
    _log_telemetry(client, run_id, m.telemetry, uploads)
    for data, name in ((m.host, "host.json"), (m.host_calibration, "host_calibration.json")):
        if data is not None:
            uploads.dict(data, name)
    if m.records_path.exists():
        uploads.file(m.records_path, "records")
    if m.server_log is not None and m.server_log.exists():
        uploads.file(m.server_log, "server")


def _log_metrics(client, run_id: str, metrics: dict[str, float], summary) -> None:
    """The run's metrics in batches of 1000; per level also as `by_concurrency/<name>` with step = concurrency
    (MLflow's chart of a metric against its step)."""
    now = int(time.time() * 1000)
    rows = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    if summary is not None:
        rows += [Metric(f"by_concurrency/{k}", float(m[k]), now, int(c)) for c, m in summary.per_level.items()
                 for k in PER_LEVEL_CHARTED if k in m]
    for start in range(0, len(rows), 1000):
        client.log_batch(run_id, metrics=rows[start:start + 1000])


def _log_telemetry(client, run_id: str, telemetry, uploads: Uploads) -> None:
    """The levels' telemetry samples (a CSV table) and windows (JSON), when any level was sampled."""
    if telemetry is None or not telemetry.windows:
        return
    for name, text in telemetry.artifacts().items():
        uploads.write(name, lambda name=name, text=text: client.log_text(run_id, text, name))


def _log_plots(uploads: Uploads, m: Measurement) -> None:
    summary = m.summary
    if summary.acceptance is not None:
        uploads.figure(lambda: plots.acceptance_figure(summary.acceptance), "plots/acceptance.png")
        uploads.dict(asdict(summary.acceptance), "acceptance.json")
    tok_s = {c: lv["output_tok_s"] for c, lv in summary.per_level.items()}
    prompts = {c: int(lv.get("requests", 0)) for c, lv in summary.per_level.items()}
    uploads.figure(lambda: plots.throughput_vs_concurrency(tok_s, m.baseline_tok_s, m.option, m.workload or None,
                                                           prompts), "plots/throughput_vs_concurrency.png")
