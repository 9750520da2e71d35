"""The runner of every option that is one measurement (`option.runner` in conf/option/*.yaml): validate the
command line with the engine's own parser (or, with `server.url`, read a running server's settings back from it),
find or measure the paired baseline, then measure the option. Dry runs stop after the validation, with a run that
records the launch spec and the workload plan. A forecast (`run.forecast=true`) stops after the baseline: it logs
its own run, filled in by the forecaster the entry point hands in, and starts no option server."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.config import paths
from experiments.config.errors import Refused
from experiments.config.overlays import with_option
from experiments.engines import adapter_for
from experiments.engines.base import InvalidLaunch, Validation
from experiments.engines.config import engine_name, engine_tags
from experiments.engines.served import Served, settings_mismatch
from experiments.harness.attached import AttachedServer, check_first_visits, check_speculation, read_served
from experiments.harness.baseline import PairingRefused, find_baseline, pair_key, served_pair_key
from experiments.harness.launch import LaunchSpec, build_launch_spec
from experiments.harness.measure import console, log_common_artifacts, measure
from experiments.harness.preflight import check_assets, check_engine_env
from experiments.harness.prepare import PreparedWorkload
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.redact import redact_text
from experiments.tracking.store import flatten, host_fingerprint, log_prompt_dataset, run_tags, setup
from experiments.tracking.uploads import Uploads

# After each measured run, inside its lifecycle: analysis the entry point hands in (the harness never imports
# analysis). Called as processor(client, run_id, baseline_run_or_None, engine_name); a failing one leaves a tag.
PostRun = Callable[..., None]
# Fills a forecast run: forecaster(client, forecast_run_id, baseline_run, params) -> summary lines to print.
Forecaster = Callable[..., list[str]]
Target = LaunchSpec | Served
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


def attached(cfg: DictConfig, url: str, prepared: PreparedWorkload | None) -> Served:
    """The running server at `url`, checked to run `cfg`'s speculation and, unless a dry run (`prepared` None),
    never to have served one of the measured prompts (before any run is created)."""
    served = read_served(url, engine_name(cfg), str(cfg.engine.health_path))
    spec = cfg.spec
    check_speculation(served, spec.method, spec.get("num_steps"), spec.get("num_draft_tokens"), cfg.option.name)
    if prepared is not None:
        server = AttachedServer(served, str(cfg.engine.health_path))
        check_first_visits(server, prepared.measured_ids(), prepared.workload.reuse_prompts)
    return served


def measure_option(cfg: DictConfig, prepared: PreparedWorkload, post_run: Sequence[PostRun] = (),
                   forecaster: Forecaster | None = None) -> dict:
    if cfg.server.get("url"):
        if cfg.run.forecast:
            raise Refused("run.forecast=true starts no option server, so there is none to attach: leave server.url "
                          "unset (baseline.url measures a running baseline)")
        target: Target = attached(cfg, str(cfg.server.url), None if cfg.run.dry_run else prepared)
        validation, key = None, served_pair_key(cfg, target, prepared.digest)
    else:
        if not cfg.run.dry_run:
            check_assets(cfg)
        else:  # a dry run only validates the command line (e.g. the box's, from here), in the engine's interpreter
            check_engine_env(cfg)
        target, validation = validated_spec(cfg)
        key = pair_key(cfg, validation.version, prepared.digest)
    if cfg.run.dry_run:
        return _dry_run(cfg, target, _version(target, validation), key, prepared)
    if cfg.run.forecast:
        return forecast_option(cfg, validation, key, prepared, post_run, forecaster)
    baseline = _paired_baseline(cfg, key, prepared, post_run, target) if cfg.baseline.pair else None
    return run_measured(cfg, target, validation, key, baseline, prepared, post_run)


def _version(target: Target, validation: Validation | None) -> str:
    return target.version if isinstance(target, Served) else validation.version


def _host(cfg: DictConfig, target: Target) -> str:
    """Where a run was measured, for the drift check of a stored baseline: this machine and engine environment,
    or the host of a running server's URL."""
    if isinstance(target, Served):
        return f"attached:{urlsplit(target.url).hostname}/{cfg.site.accelerator}"
    return host_fingerprint(cfg)


def _dry_run(cfg: DictConfig, target: Target, version: str, key: str, prepared: PreparedWorkload) -> dict:
    client, exp_id = setup(cfg)
    tags = run_tags(cfg, "dry_run", engine_tags(cfg, version)) | {"specws.pair_key": key} | _extra_tags(cfg)
    with tracked_run(client, exp_id, cfg.run.name or f"{cfg.option.name}-plan", tags, flatten(cfg)) as run:
        uploads = Uploads(client, run.id)
        log_common_artifacts(uploads, target)
        uploads.dict(prepared.plan.describe(), "workload_plan.json")
        uploads.raise_first()
    if isinstance(target, Served):
        console.print(f"read back from {target.engine} {version} at {target.url}: {len(target.settings)} settings "
                      f"({', '.join(target.sources)}), speculation {target.speculation}")
    else:
        console.print(f"validated by {target.engine} {version}: {redact_text(' '.join(target.argv))}")
    console.print(f"workload {cfg.workload.name}: {prepared.plan.describe()}")
    return {"run_id": run.id}


def forecast_option(cfg: DictConfig, validation: Validation, key: str, prepared: PreparedWorkload,
                    post_run: Sequence[PostRun], forecaster: Forecaster | None) -> dict:
    """The paired baseline (found or measured), then a forecast run of the option against it; no option server."""
    if forecaster is None or not cfg.baseline.pair or cfg.spec.method == "none":
        raise InvalidLaunch("run.forecast=true needs a speculative option paired with a baseline "
                            "(baseline.pair=true) and a forecaster")
    baseline = _paired_baseline(cfg, key, prepared, post_run, None)
    client, exp_id = setup(cfg)
    tags = (run_tags(cfg, "forecast", engine_tags(cfg, validation.version)) | {"specws.pair_key": key}
            | {"specws.baseline_run_id": baseline.info.run_id} | _extra_tags(cfg))
    name = cfg.run.name or f"{cfg.option.name}-{cfg.workload.name}-forecast"
    params = flatten(cfg)
    with tracked_run(client, exp_id, name, tags, params) as run:
        for line in forecaster(client, run.id, baseline, params):
            console.print(line)
    return {"run_id": run.id, "baseline_run_id": baseline.info.run_id}


def _paired_baseline(cfg: DictConfig, key: str, prepared: PreparedWorkload, post_run: Sequence[PostRun],
                     target: Target | None):
    """A stored baseline that matches (same key and host, recent, no failed request, not measured on a loaded
    host), else a fresh one: the config with conf/option/baseline.yaml laid over it, on the same engine and
    limits -- launched, or the running server of `baseline.url`, whose settings must be the option's."""
    client, exp_id = setup(cfg)
    found = _stored_baseline(client, exp_id, cfg, key, target) if cfg.baseline.lookup else None
    if found is not None:
        return found
    bcfg = with_option(cfg, "baseline")
    bcfg.run.name = f"baseline-{cfg.workload.name}"
    if cfg.baseline.get("url"):
        btarget, bvalidation = _attached_baseline(bcfg, str(cfg.baseline.url), key, prepared, target)
    elif isinstance(target, Served):
        raise Refused(f"no stored baseline matches the server at {target.url} (pairing key {key}); give the running "
                      "baseline server as baseline.url, or set baseline.pair=false")
    else:
        btarget, bvalidation = validated_spec(bcfg)
    console.print("no matching baseline in the store (same key and host, recent, no failed request): "
                  "measuring one first")
    return client.get_run(run_measured(bcfg, btarget, bvalidation, key, None, prepared, post_run)["run_id"])


def _stored_baseline(client, exp_id: str, cfg: DictConfig, key: str, target: Target | None):
    host = _host(cfg, target) if target is not None else host_fingerprint(cfg)
    allow_loaded = bool(cfg.baseline.allow_loaded_host)
    found = find_baseline(client, exp_id, key, host, float(cfg.baseline.max_age_h), allow_loaded)
    if found is not None:
        console.print(f"paired with baseline run {found.info.run_id}")
    elif not allow_loaded and (loaded := find_baseline(client, exp_id, key, host, float(cfg.baseline.max_age_h),
                                                       True)) is not None:
        console.print(f"stored baseline run {loaded.info.run_id} matches but was measured while other processes kept "
                      "the host busy (specws.host_loaded): not reused; baseline.allow_loaded_host=true reuses it")
    return found


def _attached_baseline(bcfg: DictConfig, url: str, key: str, prepared: PreparedWorkload,
                       target: Target | None) -> tuple[Served, None]:
    """The running baseline server of `baseline.url`: refused unless it is the option's server in everything
    but speculation (both read back from the servers)."""
    if not isinstance(target, Served):
        raise Refused("baseline.url pairs a running baseline with a running option server: give the option's as "
                      "server.url, or leave baseline.url unset to launch the baseline")
    served = attached(bcfg, url, prepared)
    if served_pair_key(bcfg, served, prepared.digest) != key:
        differ = settings_mismatch(target.settings, served.settings)
        if target.version != served.version:
            differ.insert(0, f"engine version: {target.version} vs {served.version}")
        raise PairingRefused(f"the baseline server at {url} differs from the option's at {target.url} in more than "
                             f"speculation: {'; '.join(differ[:20]) or 'settings one of them does not report'}")
    return served, None


def run_measured(cfg: DictConfig, target: Target, validation: Validation | None, key: str, baseline,
                 prepared: PreparedWorkload, post_run: Sequence[PostRun] = ()) -> dict:
    """One measured MLflow run, ended FINISHED / FAILED / KILLED by the one run lifecycle. Its metrics are logged
    before any artifact; an artifact that could not be written fails the run last, with the first such error."""
    client, exp_id = setup(cfg)
    name = cfg.run.name or f"{cfg.option.name}-{cfg.workload.name}"
    version = _version(target, validation)
    tags = (run_tags(cfg, "measure", engine_tags(cfg, version)) | {"specws.pair_key": key}
            | {"specws.host": _host(cfg, target)} | _extra_tags(cfg))
    with tracked_run(client, exp_id, name, tags, flatten(cfg)) as run:
        records_path = out_dir() / f"records-{run.id}.jsonl"
        console.print(f"MLflow run [bold]{name}[/] ({run.id}) in {cfg.tracking.experiment}; records: {records_path}")
        client.set_tag(run.id, "specws.records_path", str(records_path))
        uploads = Uploads(client, run.id, records_path)
        log_common_artifacts(uploads, target)
        _log_workload(client, uploads, run.id, cfg, prepared)
        metrics = measure(client, run.id, cfg, target, records_path, baseline, prepared, validation, uploads)
        for processor in post_run:  # the measurement is logged: what follows must not lose it
            try:
                processor(client, run.id, baseline, target.engine)
            except Exception as exc:  # noqa: BLE001
                reason = f"{processor.__name__}: {type(exc).__name__}: {exc}"
                client.set_tag(run.id, "specws.post_run_failed", reason[:5000])
                console.print(f"[yellow]post-run {processor.__name__} failed[/]: {exc}")
        uploads.raise_first()
    return {"run_id": run.id, **metrics}


def _extra_tags(cfg: DictConfig) -> dict[str, str]:
    return {k: str(v) for k, v in (cfg.run.get("tags") or {}).items()}


def _log_workload(client, uploads: Uploads, run_id: str, cfg: DictConfig, prepared: PreparedWorkload) -> None:
    client.set_tag(run_id, "specws.prompts_digest", prepared.digest)
    uploads.dict(prepared.plan.describe(), "workload_plan.json")
    rows = [{"id": c.id, "category": c.category, "turns": c.num_turns, "source": c.source,
             "text": (c.raw_prompt or "\n---\n".join(c.user_turns))[:2000]} for c in prepared.conversations]
    uploads.write("prompt_set.json", lambda: log_prompt_dataset(client, run_id, str(cfg.workload.name),
                                                                str(cfg.workload.prompt_set), rows, prepared.digest))


def out_dir() -> Path:
    """The Hydra job's output folder (its own per job), else the cache's runs folder."""
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return paths.cache_dir() / "runs"
