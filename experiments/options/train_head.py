"""Option D: train an EAGLE-3 head for the target (a tracked MLflow run), then evaluate it through the
ordinary runner as option C, linked to the training run."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from experiments.harness.measure import console
from experiments.tracking.store import PARENT_ENV, flatten, log_params, run_tags, setup

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


def train_and_evaluate(cfg: DictConfig, evaluate: Callable[[DictConfig], dict]) -> dict:
    if not cfg.model.embedded:  # SpecForge trains it on the box; here its checked plan becomes a D-plan run
        from experiments.options.specforge_plan import plan
        return plan(cfg)
    client, exp_id = setup(cfg)
    tags = run_tags(cfg, "n/a", "train") | {"mlflow.runName": "D-train"}
    if os.environ.get(PARENT_ENV):
        tags["mlflow.parentRunId"] = os.environ[PARENT_ENV]
    run_id = client.create_run(exp_id, run_name="D-train", tags=tags).info.run_id
    log_params(client, run_id, {k: v for k, v in flatten(cfg).items()
                                if k.startswith(("train.", "model.", "site.name", "option."))})
    console.print(f"MLflow run [bold]D-train[/] ({run_id}): training an EAGLE-3 head for {cfg.model.name}")
    try:
        metrics = _train(cfg, client, run_id)
    except BaseException as exc:
        client.set_tag(run_id, "specws.failure", f"{type(exc).__name__}: {exc}"[:5000])
        client.set_terminated(run_id, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    eval_cfg = _as_evaluation(cfg, run_id)
    result = evaluate(eval_cfg)
    client.set_tag(run_id, "specws.evaluation_run_id", result.get("run_id", ""))
    return {"training_run_id": run_id, "training": metrics, **result}


def _train(cfg: DictConfig, client: MlflowClient, run_id: str) -> dict:
    from experiments.eagle3.train import train_head

    t = cfg.train
    out = Path(str(t.out_dir))
    metrics = train_head(out, seed=t.seed, steps=t.steps, ttt_steps=t.ttt_steps, time_budget_s=t.minutes * 60,
                         draft_vocab_size=t.draft_vocab_size, learning_rate=t.learning_rate,
                         num_prompts=t.num_prompts, max_new_tokens=t.max_new_tokens, model_path=str(cfg.model.path),
                         synthetic_prompts=int(t.get("synthetic_prompts", 0)),
                         device=str(t.get("device", "auto")),
                         log=lambda name, value, step: client.log_metric(run_id, name, float(value), step=step))
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    for k, v in scalars.items():
        client.log_metric(run_id, f"final/{k}", v)
    client.log_artifacts(run_id, str(out), "head")
    return metrics


def _as_evaluation(cfg: DictConfig, training_run_id: str) -> DictConfig:
    """The same experiment as option C (or B) with the freshly trained head."""
    evaluation = OmegaConf.to_container(cfg, resolve=True)
    target = cfg.option.get("evaluate_as", "C")
    evaluation["option"] = {"name": target, "title": f"EAGLE-3 head from option D ({training_run_id[:8]})",
                            "engine": "vllm" if target == "C" else "sglang", "missing": None,
                            "alternative": None}
    evaluation["run"]["tags"] = {**evaluation["run"].get("tags", {}), "specws.training_run_id": training_run_id}
    return OmegaConf.create(evaluation)
