"""`python -m experiments.run +option=X [overrides]`: one experiment (or `-m` for a sweep).

Hydra composes conf/ -> preflight refuses a bad input before anything starts (dry runs included) -> the workload
is read and planned -> the option's runner (`option.runner._target_` in conf/option/X.yaml) launches, measures
and records; experiments.harness.pipeline is the runner of every option that is one measurement.
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
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.analysis.forecast.runs import forecast_check, log_forecast
from experiments.analysis.post_run import log_run_analysis
from experiments.analysis.verdict_block import log_verdict_block
from experiments.config import paths
from experiments.config.closed import refuse_unknown_overrides
from experiments.config.views import typed_run
from experiments.engines.base import InvalidLaunch
from experiments.harness.baseline import PairingRefused
from experiments.harness.devices import held, job_devices, job_line
from experiments.harness.measure import console
from experiments.harness.pipeline import Hooks
from experiments.harness.preflight import Refused, check_inputs, check_option
from experiments.harness.prepare import prepare_workload
from experiments.harness.server import POOL
from experiments.harness.workloads.formats import WorkloadError
from experiments.tracking import redact
from experiments.tracking.console_guard import guard_console, quiet_console

SITE_ENV = "SPECWS_SITE"
VERBOSE_FLAGS = ("-v", "--verbose")   # spelled on the command line as run.verbose=true
LOCAL_SITE = paths.ROOT / "conf" / "local" / "site.yaml"
# Analysis run on each measured run after its measurement, inside its lifecycle; the verdict block last (it reads
# what the others logged, and is the last thing a run prints).
POST_RUN = (log_run_analysis, forecast_check, log_verdict_block)
# Fills the run of `run.forecast=true` (refused by check_option for a runner that makes no forecast).
FORECASTER = log_forecast


def experiment(cfg: DictConfig) -> dict:
    run = typed_run(cfg)   # the config typed once: everything below reads this
    check_option(run)
    check_inputs(run)
    try:  # before anything starts, dry runs included: a broken row costs no engine start
        prepared = prepare_workload(run)
    except WorkloadError as exc:
        raise Refused(f"workload {run.workload.name}: {exc}") from None
    hooks = Hooks(POST_RUN, FORECASTER if run.run.forecast else None)
    # Past every refusal: a run that starts servers waits here for their devices (another job's on this host),
    # before it looks for its baseline, so that it finds the one the job it waited for measured; its pooled
    # servers then hold them while they live (experiments/harness/devices.py)
    POOL.accelerator = run.site.accelerator
    with held(job_devices(run), job_line()):
        return get_method(run.runner)(run, prepared, hooks)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _redact_hydra_folder(cfg: DictConfig) -> None:
    """Register the secrets of the config, the command line and the environment, and mask them in the Hydra
    folder (.hydra/*.yaml, a sweep's multirun.yaml) before a run uploads it."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:   # the runner refuses it later, with its own message
        container = OmegaConf.to_container(cfg, resolve=False)
    hydra_cfg = HydraConfig.get()
    redact.register_secrets(redact.secrets_of_config(container) | redact.secrets_of_environ(os.environ)
                            | redact.secrets_of_overrides(hydra_cfg.overrides.task))
    files = sorted((Path(hydra_cfg.runtime.output_dir) / ".hydra").glob("*.yaml"))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        files += [p for p in [Path(hydra_cfg.sweep.dir) / "multirun.yaml"] if p.exists()]
    for path in files:
        try:
            redact.redact_file(path)
        except OSError as exc:
            console.print(f"[yellow]could not redact {path}[/]: {exc}")


def task(cfg: DictConfig) -> dict | None:
    """One Hydra job. A module-level name of its own (`main` is Hydra's wrapper): submitit's launchers pickle
    the task function by reference, so a job in another process imports it."""
    guard_console()   # a job started by a launcher in its own process comes here without __main__
    quiet_console(bool(OmegaConf.select(cfg, "run.verbose", default=False)))   # Hydra set this job's log handlers
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)   # a closed terminal: torn down and KILLED like Ctrl-C
    # A shell starting us in the background (`cmd &`, nohup, some CI runners) leaves SIGINT ignored, and Python
    # then never raises KeyboardInterrupt: Ctrl-C / `kill -INT` must still tear the servers down.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a stuck run is
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    _redact_hydra_folder(cfg)
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


main = hydra.main(config_path=str(paths.ROOT / "conf"), config_name="config", version_base="1.3")(task)


def write_local_site(site: str, path=LOCAL_SITE) -> bool:
    """SPECWS_SITE=<site> chooses this machine's site once: written as conf/local/site.yaml (git-ignored), which
    conf/config.yaml's `optional local: site` composes; a `site=` override on the command line still wins."""
    text = f"# @package _global_\n# written from {SITE_ENV}={site}\ndefaults:\n  - override /site: {site}\n"
    if not (paths.ROOT / "conf" / "site" / f"{site}.yaml").exists():
        raise SystemExit(f"{SITE_ENV}={site}: no such site (conf/site/)")
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def refuse_before_hydra(args: list[str]) -> None:
    """Before Hydra composes: the command line's and the environment's secrets kept off the console (Hydra prints
    the overrides of a failed job), and an override of an undeclared key refused naming the nearest one (exit 2)."""
    guard_console()
    quiet_console(verbose_asked(args))
    redact.register_secrets(redact.secrets_of_overrides(args) | redact.secrets_of_environ(os.environ))
    try:
        refuse_unknown_overrides(args)
    except Refused as exc:
        console.print(f"[bold red]refused:[/] {exc}")
        sys.exit(2)


def verbose_flags(args: list[str]) -> list[str]:
    """`-v` / `--verbose` as the override Hydra understands: run.verbose=true."""
    return ["run.verbose=true" if a in VERBOSE_FLAGS else a for a in args]


def verbose_asked(args: list[str]) -> bool:
    """Whether the command line asks for run.verbose (before Hydra composes: the config's value comes per job)."""
    given = [a.partition("=")[2].lower() for a in args if a.lstrip("+").startswith("run.verbose=")]
    return bool(given) and given[-1] in ("true", "1", "yes", "on")


if __name__ == "__main__":
    sys.argv[1:] = verbose_flags(sys.argv[1:])
    refuse_before_hydra(sys.argv[1:])
    if os.environ.get(SITE_ENV):
        write_local_site(os.environ[SITE_ENV])
    # This module by its name, not as __main__: submitit pickles `task` by reference only from an importable module
    from experiments.run import main as importable_main

    importable_main()
