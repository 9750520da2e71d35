"""`python -m experiments.run +option=X [overrides]`: one measured experiment (or `-m` for a sweep).

config -> launch spec (validated by the engine's parser) -> baseline pairing -> measured MLflow run.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments.config import paths  # noqa: F401  (registers the ws.* resolvers)
from experiments.analysis.post_run import log_run_analysis
from experiments.engines import adapter_for
from experiments.engines.base import InvalidLaunch, Validation
from experiments.harness.prepare import PreparedWorkload, prepare_workload
from experiments.harness.workloads.formats import WorkloadError
from experiments.harness.launch import LaunchSpec, build_launch_spec
from experiments.harness.measure import baseline_cfg, console, log_common_artifacts, measure, start_run
from experiments.harness.baseline import PairingRefused, find_baseline, pair_key
from experiments.harness.preflight import Refused, check_assets, check_option
from experiments.harness.server import POOL
from experiments.tracking.store import PARENT_ENV, host_fingerprint, log_prompt_dataset, setup
from experiments.options.train_head import train_and_evaluate

SITE_ENV = "SPECWS_SITE"
SITE_FILE = paths.ROOT / ".specws-site"
_validated: dict[tuple, Validation] = {}


def validated_spec(cfg: DictConfig) -> tuple[LaunchSpec, Validation]:
    spec = build_launch_spec(cfg)
    key = (spec.python, tuple(spec.args))
    if key not in _validated:
        _validated[key] = adapter_for(spec.engine).validate(spec.python, spec.args)
    result = _validated[key]
    if not result.ok:
        raise InvalidLaunch(f"{spec.engine} {result.version} refused the command line:\n{result.error}")
    return spec, result


def run_measured(cfg: DictConfig, spec: LaunchSpec, validation: Validation, key: str, baseline,
                 prepared: PreparedWorkload) -> dict:
    client, exp_id = setup(cfg)
    name = cfg.run.name or f"{cfg.option.name}-{cfg.workload.name}"
    run_id = start_run(client, exp_id, cfg, name, validation.version, "measure", key, os.environ.get(PARENT_ENV))
    console.print(f"MLflow run [bold]{name}[/] ({run_id}) in {cfg.tracking.experiment}")
    log_common_artifacts(client, run_id, spec)
    _log_workload(client, run_id, cfg, prepared)
    try:
        metrics = measure(client, run_id, cfg, spec, _out_dir(), baseline, prepared, validation)
        log_run_analysis(client, run_id, baseline, spec.engine)
    except KeyboardInterrupt:
        client.set_tag(run_id, "specws.failure", "interrupted (Ctrl-C / SIGTERM)")
        client.set_terminated(run_id, "KILLED")
        raise
    except BaseException as exc:
        client.set_tag(run_id, "specws.failure", f"{type(exc).__name__}: {exc}"[:5000])
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return {"run_id": run_id, **metrics}


def _log_workload(client, run_id: str, cfg: DictConfig, prepared: PreparedWorkload) -> None:
    client.set_tag(run_id, "specws.prompts_digest", prepared.digest)
    client.log_dict(run_id, prepared.plan.describe(), "workload_plan.json")
    rows = [{"id": c.id, "category": c.category, "turns": c.num_turns, "source": c.source,
             "text": (c.raw_prompt or "\n---\n".join(c.user_turns))[:2000]} for c in prepared.conversations]
    log_prompt_dataset(client, run_id, str(cfg.workload.name), str(cfg.workload.prompt_set), rows, prepared.digest)


def experiment(cfg: DictConfig) -> dict:
    check_option(cfg)
    try:  # before anything starts, dry runs included: a broken row costs no engine start
        prepared = prepare_workload(cfg)
    except WorkloadError as exc:
        raise Refused(f"workload {cfg.workload.name}: {exc}") from None
    if cfg.option.name == "D" and not cfg.run.dry_run:
        return train_and_evaluate(cfg, experiment)
    if not cfg.run.dry_run:  # a dry run only validates the command line (e.g. the box's, from here)
        check_assets(cfg)
    spec, validation = validated_spec(cfg)
    key = pair_key(cfg, validation.version, prepared.digest)
    client, exp_id = setup(cfg)
    if cfg.run.dry_run:
        run_id = start_run(client, exp_id, cfg, cfg.run.name or f"{cfg.option.name}-plan",
                           validation.version, "dry_run", key, os.environ.get(PARENT_ENV))
        log_common_artifacts(client, run_id, spec)
        client.log_dict(run_id, prepared.plan.describe(), "workload_plan.json")
        client.set_terminated(run_id, "FINISHED")
        console.print(f"validated by {spec.engine} {validation.version}: {' '.join(spec.argv)}")
        console.print(f"workload {cfg.workload.name}: {prepared.plan.describe()}")
        return {"run_id": run_id}
    baseline = None
    if cfg.option.name != "baseline" and cfg.baseline.pair:
        baseline = (find_baseline(client, exp_id, key, host_fingerprint(cfg), float(cfg.baseline.max_age_h))
                    if cfg.baseline.lookup else None)
        if baseline is None:
            console.print("no matching baseline in the store (same key and host, recent, no failed request): "
                          "measuring one first")
            bcfg = baseline_cfg(cfg)
            bspec, bvalidation = validated_spec(bcfg)
            base_id = run_measured(bcfg, bspec, bvalidation, key, None, prepared)["run_id"]
            baseline = client.get_run(base_id)
        else:
            console.print(f"paired with baseline run {baseline.info.run_id}")
    return run_measured(cfg, spec, validation, key, baseline, prepared)


def _out_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return paths.cache_dir() / "runs"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict | None:
    signal.signal(signal.SIGTERM, _raise_interrupt)
    # A shell starting us in the background (`cmd &`, nohup, some CI runners) leaves SIGINT ignored, and Python
    # then never raises KeyboardInterrupt: Ctrl-C / `kill -INT` must still tear the servers down.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a stuck run is
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return experiment(cfg)
    except (Refused, InvalidLaunch, PairingRefused) as exc:
        console.print(f"[bold red]refused:[/] {exc}")
        if multirun:
            raise
        sys.exit(2)
    finally:
        if not multirun:
            POOL.close_all()


def _select_site(argv: list[str]) -> list[str]:
    """The box user picks the site once (SPECWS_SITE or a git-ignored .specws-site file)."""
    if any(a.split("=", 1)[0].lstrip("+~") == "site" for a in argv):
        return argv
    site = os.environ.get(SITE_ENV) or (SITE_FILE.read_text().strip() if SITE_FILE.exists() else "")
    if not site:
        return argv
    # Hydra's overrides are one positional group: join it rather than start a second one.
    at = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), len(argv))
    return [*argv[:at], f"site={site}", *argv[at:]]


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *_select_site(sys.argv[1:])]
    main()
