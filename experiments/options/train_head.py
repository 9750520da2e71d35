"""Option D: train an EAGLE-3 head for the target (a tracked MLflow run), then evaluate it through the
ordinary runner as option C, linked to the training run."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from experiments.config.errors import Refused
from experiments.config.overlays import with_option
from experiments.config.views import RunView, views_of
from experiments.engines.config import engine_tags
from experiments.harness.measure import console
from experiments.harness.pipeline import Hooks, measure_option
from experiments.harness.prepare import PreparedWorkload
from experiments.tracking.runs import open_run
from experiments.tracking.store import flatten, log_inputs

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


def train_and_evaluate(run: RunView, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """Option D's runner. A dry run validates the evaluation's command line; a model that is not embedded gets
    SpecForge's checked plan (training runs on the box)."""
    cfg = run.config
    if run.run.forecast:
        raise Refused("option D trains a head before anything can be forecast: run.forecast=true is for options "
                      "that are one measurement (forecast the trained head as +option=C spec.draft_model=<head>)")
    if run.run.dry_run:
        return measure_option(run, prepared, hooks)
    if not cfg.model.embedded:
        from experiments.options.specforge_plan import plan
        return plan(cfg)
    params = {k: v for k, v in flatten(cfg).items() if k.startswith(("train.", "model.", "site.name", "option."))}
    with open_run(run, "train", "D-train", engine_tags(run, "n/a"), params) as training:
        console.print(f"MLflow run [bold]D-train[/] ({training.id}): training an EAGLE-3 head for {run.model.name}")
        metrics = _train(cfg, training.client, training.id)
    result = measure_option(views_of(_as_evaluation(cfg, training.id)), prepared, hooks)
    training.client.set_tag(training.id, "specws.evaluation_run_id", result.get("run_id", ""))
    return {"training_run_id": training.id, "training": metrics, **result}


def _train(cfg: DictConfig, client: MlflowClient, run_id: str) -> dict:
    from experiments.eagle3.train import train_head

    t = cfg.train
    out = Path(str(t.out_dir))
    metrics = train_head(out, seed=t.seed, steps=t.steps, ttt_steps=t.ttt_steps, time_budget_s=t.minutes * 60,
                         draft_vocab_size=t.draft_vocab_size, learning_rate=t.learning_rate,
                         num_prompts=t.num_prompts, max_new_tokens=t.max_new_tokens, model_path=str(cfg.model.path),
                         synthetic_prompts=int(t.get("synthetic_prompts", 0)),
                         device=str(t.get("device", "auto")), data=str(t.get("data", "synthetic")),
                         sharegpt=OmegaConf.to_container(t.sharegpt, resolve=True) if "sharegpt" in t else None,
                         log=lambda name, value, step: client.log_metric(run_id, name, float(value), step=step))
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    for k, v in scalars.items():
        client.log_metric(run_id, f"final/{k}", v)
    client.log_artifacts(run_id, str(out), "head")
    if "data_files" in metrics:
        log_data_split(client, run_id, Path(metrics["data_files"]["manifest"]), Path(metrics["data_files"]["split"]))
    return metrics


SPLIT_CONTEXTS = {"train": "training", "val": "validation", "excluded": "excluded"}


def log_data_split(client: MlflowClient, run_id: str, manifest: Path, split: Path) -> None:
    """The training data's split as MLflow datasets (one per side: training, validation, excluded), one row per
    conversation (id, reason, user turns, hash of its first turn), and the manifest as `data_manifest.json`."""
    import json
    import warnings

    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    from experiments.harness.workloads.sharegpt import sharegpt_path

    info = json.loads(manifest.read_text())
    client.log_dict(run_id, info, "data_manifest.json")
    if not hasattr(client, "log_inputs"):
        return
    source = str(sharegpt_path())
    rows = pd.read_json(split, lines=True, dtype={"id": str, "reason": str, "first_turn_sha": str})
    inputs = []
    with warnings.catch_warnings():     # MLflow's notes on local sources and integer columns
        warnings.simplefilter("ignore")
        for side, context in SPLIT_CONTEXTS.items():
            part = rows[rows["side"] == side].reset_index(drop=True)
            digest = info[f"{side}_ids_sha256"][:36]
            dataset = mlflow.data.from_pandas(part, source=source, name=f"sharegpt-{side}", digest=digest)
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
    log_inputs(client, run_id, inputs)


def _as_evaluation(cfg: DictConfig, training_run_id: str) -> DictConfig:
    """The same experiment, with the freshly trained head, as the option D evaluates as (conf/option/<evaluate_as>):
    that option's block, D's speculation settings (the trained head) and a tag linking the training run."""
    target = str(cfg.option.evaluate_as)
    title = f"EAGLE-3 head from option D ({training_run_id[:8]})"
    evaluation = with_option(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), target, ("option",),
                             title=title)
    evaluation.run.tags = {**evaluation.run.get("tags", {}), "specws.training_run_id": training_run_id}
    return evaluation
