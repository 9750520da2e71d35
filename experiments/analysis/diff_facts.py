"""What one stored run says about how it ran, as flat sections of text values for experiments.analysis.diff:

- `engine`: the resolved engine arguments: `host.json`'s (read from the server), else the server log's
  (`server/*.log`: SGLang's ServerArgs, vLLM's engine config, experiments/engines/server_log.py), and the SGLang
  patches applied;
- `graphs`: the captured CUDA-graph batch sizes per graph (the same sources);
- `host`: `host.json`'s CPU and GPU facts (clocks at most, not now), else the run's host tags;
- `calibration`: `host_calibration.json`, per level the median of each probe term and the states seen;
- `packages`: the version tags, and `host.json`'s package list;
- `head`: `host.json`'s head digest;
- `workload`, `limits`, `config`, `run`: the run's params and tags by prefix.
A section a run did not record is named in `missing` with why."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from experiments.analysis.report.inputs import _lookup_errors
from experiments.engines.served import flat
from experiments.engines.server_log import read_log, resolved_args

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
HOST_SKIPPED = ("recorded_unix", "hostname", "platform", "sm_clock_mhz", "mem_clock_mhz", "temp_c", "pstate",
                "clock_event_reasons", "mhz_min_core", "mhz_max_core", "status", "uuid")
PARAM_SECTIONS = (("workload.", "workload"), ("limits.", "limits"), ("spec.", "config"), ("model.", "config"),
                  ("option.", "config"), ("engine.", "config"), ("site.", "config"))
TAG_SECTIONS = (("versions.", "packages"), ("specws.engine_version", "packages"), ("host.pkg.", "packages"),
                ("host.packages_", "packages"), ("host.", "host"), ("specws.host", "host"),
                ("specws.prompts_digest", "workload"), ("sglang_patches.", "engine"))


@dataclass
class RunFacts:
    run_id: str
    label: str
    sections: dict[str, dict[str, str]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    def put(self, section: str, values: dict[str, object]) -> None:
        self.sections.setdefault(section, {}).update({k: _text(v) for k, v in values.items()})


def _text(value: object) -> str:
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def _artifact(client, run_id: str, path: str, tmp: Path) -> Path | None:
    try:
        return Path(client.download_artifacts(run_id, path, str(tmp)))
    except _lookup_errors():
        return None


def _json(client, run_id: str, path: str, tmp: Path) -> dict | None:
    local = _artifact(client, run_id, path, tmp)
    return json.loads(local.read_text()) if local is not None and local.is_file() else None


def read_run(client, run_id: str) -> RunFacts:
    """The sections of one run (a store's MLflow run id)."""
    run = client.get_run(run_id)
    started = datetime.fromtimestamp(run.info.start_time / 1000, UTC).strftime("%Y-%m-%d %H:%M")
    facts = RunFacts(run_id, f"{run.info.run_name or run_id} ({started} UTC, {run_id[:8]})")
    params, tags = dict(run.data.params), dict(run.data.tags)
    _params_and_tags(facts, params, tags)
    with tempfile.TemporaryDirectory(prefix="diff-") as tmp:
        host = _json(client, run_id, "host.json", Path(tmp))
        calibration = _json(client, run_id, "host_calibration.json", Path(tmp))
        _engine(facts, host, None if host else _server_log(client, run_id, Path(tmp)))
    _host(facts, host)
    _calibration(facts, calibration)
    return facts


def _drop_summary_tags(facts: RunFacts, host: dict) -> None:
    """The `host.<key>` tags summarise host.json: compared there, not twice."""
    for key in host.get("summary") or {}:
        for section in ("host", "packages"):
            facts.sections.get(section, {}).pop(f"host.{key}", None)


def _params_and_tags(facts: RunFacts, params: dict[str, str], tags: dict[str, str]) -> None:
    for key, value in params.items():
        section = next((s for prefix, s in PARAM_SECTIONS if key.startswith(prefix)), "run")
        facts.put(section, {key: value})
    for key, value in tags.items():
        section = next((s for prefix, s in TAG_SECTIONS if key.startswith(prefix)), "run")
        facts.put(section, {key: value})


def _server_log(client, run_id: str, tmp: Path) -> Path | None:
    folder = _artifact(client, run_id, "server", tmp)
    logs = sorted(folder.glob("*.log")) if folder is not None and folder.is_dir() else []
    return logs[-1] if logs else None


def _engine(facts: RunFacts, host: dict | None, log: Path | None) -> None:
    """Engine arguments and graphs from host.json, else from the server log."""
    engine = (host or {}).get("engine") or {}
    if engine:
        args, graphs, source = resolved_args(engine), engine.get("graphs") or {}, "host.json"
    else:
        parsed = read_log(log)
        args = {**{f"config.{k}": v for k, v in parsed.non_default.items()}, **parsed.args}
        graphs, source = parsed.graphs, f"server log {log.name}" if log else ""
    if args:
        facts.put("engine", flat(args))
        facts.sections["engine"]["(source)"] = source
    else:
        facts.missing["engine"] = "no host.json and no server log with the engine's arguments"
    if graphs:
        facts.put("graphs", {f"{name}.{k}": v for name, g in graphs.items() for k, v in g.items() if k != "backend"})
    else:
        facts.missing["graphs"] = "no captured CUDA-graph sizes recorded (or none captured)"


def _host(facts: RunFacts, host: dict | None) -> None:
    if host is None:
        facts.missing["host.json"] = "no host fingerprint (recorded before host.json existed)"
        facts.missing["head"] = "no head digest (no host.json)"
        return
    _drop_summary_tags(facts, host)
    for part in ("cpu", "gpu"):
        values = flat(host.get(part) or {}, part)
        facts.put("host", {k: v for k, v in values.items() if k.rsplit(".", 1)[-1] not in HOST_SKIPPED})
    windows = list((host.get("windows") or {}).values())
    if windows:
        facts.put("host", {"windows.steal_pct_mean": f"{statistics.mean(w['steal_pct'] for w in windows):.1f}"})
    packages = host.get("packages") or {}
    facts.put("packages", {f"pkg:{line.split('==', 1)[0]}": line.split("==", 1)[1]
                           for line in packages.get("list") or [] if "==" in line})
    facts.put("packages", {k: packages[k] for k in ("sha256", "count", "python_version") if k in packages})
    head = host.get("head")
    if head:
        facts.put("head", {k: head.get(k) for k in ("sha256", "config_sha256", "error") if head.get(k)})
    else:
        facts.missing["head"] = "the run served no head"


def _calibration(facts: RunFacts, calibration: dict | None) -> None:
    if calibration is None:
        facts.missing["calibration"] = "no host_calibration.json (recorded before the host calibration existed)"
        return
    samples = calibration.get("samples") or []
    values: dict[str, list[float]] = {}
    for s in samples:
        for term, v in (s.get("terms") or {}).items():
            values.setdefault(f"c{s['level']}.{term}", []).append(float(v))
    facts.put("calibration", {k: f"{statistics.median(v):.4g}" for k, v in values.items()})
    facts.put("calibration", {f"c{c}.states": ",".join(lv.get("states") or [])
                              for c, lv in (calibration.get("levels") or {}).items()})
    facts.put("calibration", {"status": calibration.get("status"), "changed": sorted(calibration.get("changed") or {})})
