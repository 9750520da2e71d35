"""Measured runs on a known step schedule: the workspace client against the loopback server streaming SGLang
/generate events, summarised by the workspace's own code and logged into an MLflow store like a real run."""
from __future__ import annotations

from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from experiments.engines.sglang_engine import SGLangAdapter
from experiments.harness.summary import summarize
from tests.helpers.loopback_server import start_loopback

T1, OVERHEAD, B_TOK, DRAFT = 4.0, 2.0, 1.0, 0.5   # ms: decode step, speculative-step overhead, per token, per draft


def step_ms(q: int, draft_steps: int = 0) -> float:
    """The known schedule the loopback runs stream on: a step verifying q tokens with `draft_steps` drafts."""
    return T1 + (OVERHEAD + B_TOK * (q - 1) if q > 1 else 0.0) + DRAFT * draft_steps


def log_loopback_run(client: MlflowClient, exp: str, tmp: Path, name: str, params: dict, itl_ms: float,
                     per_event: int, baseline_id: str | None = None, levels: tuple[int, ...] = (1,),
                     tokens: int = 48, tags: dict | None = None) -> str:
    """One FINISHED run: `per_event` tokens every `itl_ms` per request, at each concurrency of `levels`."""
    from conftest import run_fixed
    server = start_loopback(ttft_ms=5.0, itl_ms=itl_ms, tokens_per_event=per_event)
    path = tmp / f"records-{name}.jsonl"
    try:
        measured = run_fixed(server, SGLangAdapter(), tokens, path, {f"p{i}": [100 + i, 1, 2] for i in range(4)},
                             list(levels))
    finally:
        server.stop()
    run_tags = {"specws.mode": "measure", "specws.option": name, "specws.workload": "loopback", **(tags or {}),
                **({"specws.baseline_run_id": baseline_id} if baseline_id else {})}
    run_id = client.create_run(exp, run_name=name, tags=run_tags).info.run_id
    for k, v in {"engine.name": "sglang", "spec.method": "none", **params}.items():
        client.log_param(run_id, k, v)
    metrics = summarize(measured, SGLangAdapter()).metrics
    client.log_batch(run_id, metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()])
    client.log_artifact(run_id, str(path), "records")
    client.set_terminated(run_id, "FINISHED")
    return run_id
