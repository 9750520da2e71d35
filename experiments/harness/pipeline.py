"""The runner of every option that is one measurement (`option.runner` in conf/option/*.yaml): validate the
command line with the engine's own parser, find or measure the paired baseline, then measure the option.
Dry runs stop after the validation, with a run that records the launch spec and the workload plan. A forecast
(`run.forecast=true`) stops after the baseline: it logs its own run, filled in by the forecaster the entry point hands
in, and starts no option server."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.config import paths
from experiments.config.overlays import with_option
from experiments.engines import adapter_for
from experiments.engines.base import InvalidLaunch, Validation
from experiments.engines.config import engine_tags
from experiments.harness.baseline import find_baseline, pair_key
from experiments.harness.launch import LaunchSpec, build_launch_spec
from experiments.harness.measure import console, log_common_artifacts, measure
from experiments.harness.preflight import check_assets, check_engine_env
from experiments.harness.prepare import PreparedWorkload
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.store import flatten, host_fingerprint, log_prompt_dataset, run_tags, setup

# After each measured run, inside its lifecycle: analysis the entry point hands in (the harness never imports
# analysis). Called as processor(client, run_id, baseline_run_or_None, engine_name); a failing one leaves a tag.
PostRun = Callable[..., None]
# Fills a forecast run: forecaster(client, forecast_run_id, baseline_run, params) -> summary lines to print.
Forecaster = Callable[..., list[str]]
_validated: dict[tuple, Validation] = {}


def validated_spec(cfg: DictConfig) -> tuple[LaunchSpec, Validation]:
    """The launch spec, checked once per command line by the engine's own parser."""
    spec = build_launch_spec(cfg)
    key = (spec.python, tuple(spec.args))
    if key not in _validated:
        _validated[key] = adapter_for(spec.engine).validate(spec.python, spec.args)
    result = _validated[key]
    if not result.ok:
        raise InvalidLaunch(f"{spec.engine} {result.version} refused the command line:\n{result.error}")
    return spec, result


def measure_option(cfg: DictConfig, prepared: PreparedWorkload, post_run: Sequence[PostRun] = (),
                   forecaster: Forecaster | None = None) -> dict:
    if not cfg.run.dry_run:
        check_assets(cfg)
    else:  # a dry run only validates the command line (e.g. the box's, from here), in the engine's interpreter
        check_engine_env(cfg)
    spec, validation = validated_spec(cfg)
    key = pair_key(cfg, validation.version, prepared.digest)
    if cfg.run.dry_run:
        return _dry_run(cfg, spec, validation, key, prepared)
    if cfg.run.forecast:
        return forecast_option(cfg, validation, key, prepared, post_run, forecaster)
    baseline = _paired_baseline(cfg, key, prepared, post_run) if cfg.baseline.pair else None
    return run_measured(cfg, spec, validation, key, baseline, prepared, post_run)


def _dry_run(cfg: DictConfig, spec: LaunchSpec, validation: Validation, key: str, prepared: PreparedWorkload) -> dict:
    client, exp_id = setup(cfg)
    tags = run_tags(cfg, "dry_run", engine_tags(cfg, validation.version)) | {"specws.pair_key": key} | _extra_tags(cfg)
    with tracked_run(client, exp_id, cfg.run.name or f"{cfg.option.name}-plan", tags, flatten(cfg)) as run:
        log_common_artifacts(client, run.id, spec)
        client.log_dict(run.id, prepared.plan.describe(), "workload_plan.json")
    console.print(f"validated by {spec.engine} {validation.version}: {' '.join(spec.argv)}")
    console.print(f"workload {cfg.workload.name}: {prepared.plan.describe()}")
    return {"run_id": run.id}


def forecast_option(cfg: DictConfig, validation: Validation, key: str, prepared: PreparedWorkload,
                    post_run: Sequence[PostRun], forecaster: Forecaster | None) -> dict:
    """The paired baseline (found or measured), then a forecast run of the option against it; no option server."""
    if forecaster is None or not cfg.baseline.pair or cfg.spec.method == "none":
        raise InvalidLaunch("run.forecast=true needs a speculative option paired with a baseline "
                            "(baseline.pair=true) and a forecaster")
    baseline = _paired_baseline(cfg, key, prepared, post_run)
    client, exp_id = setup(cfg)
    tags = (run_tags(cfg, "forecast", engine_tags(cfg, validation.version)) | {"specws.pair_key": key}
            | {"specws.baseline_run_id": baseline.info.run_id} | _extra_tags(cfg))
    name = cfg.run.name or f"{cfg.option.name}-{cfg.workload.name}-forecast"
    params = flatten(cfg)
    with tracked_run(client, exp_id, name, tags, params) as run:
        for line in forecaster(client, run.id, baseline, params):
            console.print(line)
    return {"run_id": run.id, "baseline_run_id": baseline.info.run_id}


def _paired_baseline(cfg: DictConfig, key: str, prepared: PreparedWorkload, post_run: Sequence[PostRun]):
    """A stored baseline that matches (same key and host, recent, no failed request), else a fresh one: the
    config with conf/option/baseline.yaml laid over it, on the same engine and limits."""
    client, exp_id = setup(cfg)
    if cfg.baseline.lookup:
        found = find_baseline(client, exp_id, key, host_fingerprint(cfg), float(cfg.baseline.max_age_h))
        if found is not None:
            console.print(f"paired with baseline run {found.info.run_id}")
            return found
    console.print("no matching baseline in the store (same key and host, recent, no failed request): "
                  "measuring one first")
    bcfg = with_option(cfg, "baseline")
    bcfg.run.name = f"baseline-{cfg.workload.name}"
    bspec, bvalidation = validated_spec(bcfg)
    return client.get_run(run_measured(bcfg, bspec, bvalidation, key, None, prepared, post_run)["run_id"])


def run_measured(cfg: DictConfig, spec: LaunchSpec, validation: Validation, key: str, baseline,
                 prepared: PreparedWorkload, post_run: Sequence[PostRun] = ()) -> dict:
    """One measured MLflow run, ended FINISHED / FAILED / KILLED by the one run lifecycle."""
    client, exp_id = setup(cfg)
    name = cfg.run.name or f"{cfg.option.name}-{cfg.workload.name}"
    tags = run_tags(cfg, "measure", engine_tags(cfg, validation.version)) | {"specws.pair_key": key} | _extra_tags(cfg)
    with tracked_run(client, exp_id, name, tags, flatten(cfg)) as run:
        console.print(f"MLflow run [bold]{name}[/] ({run.id}) in {cfg.tracking.experiment}")
        log_common_artifacts(client, run.id, spec)
        _log_workload(client, run.id, cfg, prepared)
        metrics = measure(client, run.id, cfg, spec, out_dir(), baseline, prepared, validation)
        for processor in post_run:  # the measurement is logged: what follows must not lose it
            try:
                processor(client, run.id, baseline, spec.engine)
            except Exception as exc:  # noqa: BLE001
                reason = f"{processor.__name__}: {type(exc).__name__}: {exc}"
                client.set_tag(run.id, "specws.post_run_failed", reason[:5000])
                console.print(f"[yellow]post-run {processor.__name__} failed[/]: {exc}")
    return {"run_id": run.id, **metrics}


def _extra_tags(cfg: DictConfig) -> dict[str, str]:
    return {k: str(v) for k, v in (cfg.run.get("tags") or {}).items()}


def _log_workload(client, run_id: str, cfg: DictConfig, prepared: PreparedWorkload) -> None:
    client.set_tag(run_id, "specws.prompts_digest", prepared.digest)
    client.log_dict(run_id, prepared.plan.describe(), "workload_plan.json")
    rows = [{"id": c.id, "category": c.category, "turns": c.num_turns, "source": c.source,
             "text": (c.raw_prompt or "\n---\n".join(c.user_turns))[:2000]} for c in prepared.conversations]
    log_prompt_dataset(client, run_id, str(cfg.workload.name), str(cfg.workload.prompt_set), rows, prepared.digest)


def out_dir() -> Path:
    """The Hydra job's output folder (its own per job), else the cache's runs folder."""
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return paths.cache_dir() / "runs"
