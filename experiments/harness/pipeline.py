"""The runner of every option that is one measurement (`option.runner` in conf/option/*.yaml): validate the
command line with the engine's own parser (or, with `server.url`, read a running server's settings back from it),
find or measure the paired baseline, then measure the option. Dry runs stop after the validation, with a run that
records the launch spec and the workload plan. A forecast (`run.forecast=true`) stops after the baseline: it logs
its own run, filled in by the forecaster the entry point hands in, and starts no option server."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.config import paths
from experiments.config.errors import Refused
from experiments.config.overlays import with_option
from experiments.config.views import RunView, views_of
from experiments.engines import adapter_for
from experiments.engines.base import InvalidLaunch, Validation
from experiments.engines.config import engine_tags
from experiments.engines.served import Served, settings_mismatch
from experiments.harness.attached import AttachedServer, check_first_visits, check_speculation, read_served
from experiments.harness.baseline import PairingRefused, find_baseline, pair_key, served_pair_key
from experiments.harness.launch import LaunchSpec, api_key, build_launch_spec
from experiments.harness.measure import INTERLEAVED, Arm, compare_with_baseline, console, measure, measure_interleaved
from experiments.harness.preflight import check_assets, check_engine_env
from experiments.harness.prepare import PreparedWorkload
from experiments.harness.summary import check_error_share
from experiments.tracking.export import Measurement, export, export_inputs
from experiments.tracking.lifecycle import TrackedRun
from experiments.tracking.redact import redact_text
from experiments.tracking.runs import open_run, setup
from experiments.tracking.store import flatten, host_fingerprint, log_prompt_dataset, measured_digest
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


def attached(v: RunView, url: str, prepared: PreparedWorkload | None) -> Served:
    """The running server at `url`, checked to run the run's speculation and, unless a dry run (`prepared` None),
    never to have served one of the measured prompts (before any run is created)."""
    served = read_served(url, v.engine, v.health_path, api_key(v.server.api_key_env))
    check_speculation(served, v.spec.method, v.spec.num_steps, v.spec.num_draft_tokens, v.option)
    if prepared is not None:
        server = AttachedServer(served, v.health_path)
        check_first_visits(server, prepared.measured_ids(), prepared.workload.reuse_prompts)
    return served


def measure_option(cfg: DictConfig, prepared: PreparedWorkload, post_run: Sequence[PostRun] = (),
                   forecaster: Forecaster | None = None, views: RunView | None = None) -> dict:
    v = views or views_of(cfg)
    if v.server.url:
        if v.run.forecast:
            raise Refused("run.forecast=true starts no option server, so there is none to attach: leave server.url "
                          "unset (baseline.url measures a running baseline)")
        target: Target = attached(v, v.server.url, None if v.run.dry_run else prepared)
        validation, key = None, served_pair_key(cfg, target, prepared.digest)
    else:
        if not v.run.dry_run:
            check_assets(cfg)
        else:  # a dry run only validates the command line (e.g. the box's, from here), in the engine's interpreter
            check_engine_env(cfg)
        target, validation = validated_spec(cfg)
        key = pair_key(cfg, validation.version, prepared.digest)
    if v.run.dry_run:
        return _dry_run(cfg, v, target, _version(target, validation), key, prepared)
    if v.run.forecast:
        return forecast_option(cfg, v, validation, key, prepared, post_run, forecaster)
    if _interleaved(v, target):
        return run_interleaved_pair(cfg, v, target, validation, key, prepared, post_run)
    baseline = _paired_baseline(cfg, v, key, prepared, post_run, target) if v.baseline.pair else None
    return run_measured(cfg, v, target, validation, key, baseline, prepared, post_run)


def _interleaved(v: RunView, target: Target) -> bool:
    """Paired in time: asked for (baseline.timing), an option with speculation against a baseline, and both
    servers started here (a running server of server.url is paired with a stored or running baseline)."""
    if v.baseline.timing != INTERLEAVED or not v.baseline.pair or not v.spec.speculative:
        return False
    if isinstance(target, Served):
        console.print("baseline.timing=interleaved needs both servers started here; the running server of "
                      "server.url is paired with a stored or running baseline, one after the other")
        return False
    return True


def _version(target: Target, validation: Validation | None) -> str:
    return target.version if isinstance(target, Served) else validation.version


def _host(cfg: DictConfig, target: Target) -> str:
    """Where a run was measured, for the drift check of a stored baseline: this machine and engine environment,
    or the host of a running server's URL."""
    if isinstance(target, Served):
        return f"attached:{urlsplit(target.url).hostname}/{cfg.site.accelerator}"
    return host_fingerprint(cfg)


def _dry_run(cfg: DictConfig, v: RunView, target: Target, version: str, key: str, prepared: PreparedWorkload) -> dict:
    with open_run(cfg, "dry_run", v.run.name or f"{v.option}-plan",
                  engine_tags(cfg, version) | {"specws.pair_key": key}) as run:
        uploads = Uploads(run.client, run.id)
        export_inputs(uploads, *_launch_record(target))
        uploads.dict(prepared.plan.describe(), "workload_plan.json")
        uploads.raise_first()
    if isinstance(target, Served):
        console.print(f"read back from {target.engine} {version} at {target.url}: {len(target.settings)} settings "
                      f"({', '.join(target.sources)}), speculation {target.speculation}")
    else:
        console.print(f"validated by {target.engine} {version}: {redact_text(' '.join(target.argv))}")
    console.print(f"workload {v.workload.name}: {prepared.plan.describe()}")
    return {"run_id": run.id}


def _launch_record(target: Target) -> tuple[dict, str]:
    """The launch spec, or the running server's own account of itself, as recorded."""
    return (target.to_dict(), "served_server.json") if isinstance(target, Served) else \
        (target.to_dict(), "launch_spec.json")


def forecast_option(cfg: DictConfig, v: RunView, validation: Validation, key: str, prepared: PreparedWorkload,
                    post_run: Sequence[PostRun], forecaster: Forecaster | None) -> dict:
    """The paired baseline (found or measured), then a forecast run of the option against it; no option server."""
    if forecaster is None or not v.baseline.pair or not v.spec.speculative:
        raise InvalidLaunch("run.forecast=true needs a speculative option paired with a baseline "
                            "(baseline.pair=true) and a forecaster")
    baseline = _paired_baseline(cfg, v, key, prepared, post_run, None)
    tags = engine_tags(cfg, validation.version) | {"specws.pair_key": key,
                                                   "specws.baseline_run_id": baseline.info.run_id}
    params = flatten(cfg)
    with open_run(cfg, "forecast", v.run.name or f"{v.option}-{v.workload.label}-forecast", tags,
                  params) as run:
        for line in forecaster(run.client, run.id, baseline, params):
            console.print(line)
    return {"run_id": run.id, "baseline_run_id": baseline.info.run_id}


def _paired_baseline(cfg: DictConfig, v: RunView, key: str, prepared: PreparedWorkload,
                     post_run: Sequence[PostRun], target: Target | None):
    """A stored baseline that matches (same key and host, recent, no failed request, not measured on a loaded
    host), else a fresh one: the config with conf/option/baseline.yaml laid over it, on the same engine and
    limits -- launched, or the running server of `baseline.url`, whose settings must be the option's."""
    client, exp_id = setup(cfg)
    found = _stored_baseline(client, exp_id, cfg, v, key, target) if v.baseline.lookup else None
    if found is not None:
        return found
    bcfg = with_option(cfg, "baseline")
    bcfg.run.name = f"baseline-{v.workload.label}"
    bv = views_of(bcfg)
    if v.baseline.url:
        btarget, bvalidation = _attached_baseline(bcfg, bv, v.baseline.url, key, prepared, target)
    elif isinstance(target, Served):
        raise Refused(f"no stored baseline matches the server at {target.url} (pairing key {key}); give the running "
                      "baseline server as baseline.url, or set baseline.pair=false")
    else:
        btarget, bvalidation = validated_spec(bcfg)
    console.print("no matching baseline in the store (same key and host, recent, no failed request): "
                  "measuring one first")
    return client.get_run(run_measured(bcfg, bv, btarget, bvalidation, key, None, prepared, post_run)["run_id"])


def _stored_baseline(client, exp_id: str, cfg: DictConfig, v: RunView, key: str, target: Target | None):
    host = _host(cfg, target) if target is not None else host_fingerprint(cfg)
    allow_loaded, max_age_h = v.baseline.allow_loaded_host, v.baseline.max_age_h
    found = find_baseline(client, exp_id, key, host, max_age_h, allow_loaded)
    if found is not None:
        console.print(f"paired with baseline run {found.info.run_id}")
    elif not allow_loaded and (loaded := find_baseline(client, exp_id, key, host, max_age_h, True)) is not None:
        console.print(f"stored baseline run {loaded.info.run_id} matches but was measured while other processes kept "
                      "the host busy (specws.host_loaded): not reused; baseline.allow_loaded_host=true reuses it")
    return found


def _attached_baseline(bcfg: DictConfig, bv: RunView, url: str, key: str, prepared: PreparedWorkload,
                       target: Target | None) -> tuple[Served, None]:
    """The running baseline server of `baseline.url`: refused unless it is the option's server in everything
    but speculation (both read back from the servers)."""
    if not isinstance(target, Served):
        raise Refused("baseline.url pairs a running baseline with a running option server: give the option's as "
                      "server.url, or leave baseline.url unset to launch the baseline")
    served = attached(bv, url, prepared)
    if served_pair_key(bcfg, served, prepared.digest) != key:
        differ = settings_mismatch(target.settings, served.settings)
        if target.version != served.version:
            differ.insert(0, f"engine version: {target.version} vs {served.version}")
        raise PairingRefused(f"the baseline server at {url} differs from the option's at {target.url} in more than "
                             f"speculation: {'; '.join(differ[:20]) or 'settings one of them does not report'}")
    return served, None


def run_measured(cfg: DictConfig, v: RunView, target: Target, validation: Validation | None, key: str, baseline,
                 prepared: PreparedWorkload, post_run: Sequence[PostRun] = ()) -> dict:
    """One measured MLflow run, ended FINISHED / FAILED / KILLED by the one run lifecycle. The measurement is
    exported on every way out, metrics before any artifact; an artifact that could not be written fails the run
    last, with the first such error."""
    with _measured_run(cfg, v, target, validation, key, prepared) as (run, m, uploads):
        try:
            measure(m, cfg, v, target, baseline, prepared, validation, run.client)
        finally:
            export(run.client, run.id, m, uploads)
        _post_run(run, post_run, baseline, target.engine)
        uploads.raise_first()
    return {"run_id": run.id, **m.metrics}


def run_interleaved_pair(cfg: DictConfig, v: RunView, target: LaunchSpec, validation: Validation, key: str,
                         prepared: PreparedWorkload, post_run: Sequence[PostRun] = ()) -> dict:
    """Option and a fresh baseline paired in time (baseline.timing=interleaved): both servers up together, each
    block of first-seen prompts sent to one and then the other (ABBA), two runs open at once. The baseline's
    measurement is exported first, then the option is compared with it; both are exported on every way out."""
    bcfg = with_option(cfg, "baseline")
    bcfg.run.name = f"baseline-{v.workload.label}"
    bv = views_of(bcfg)
    btarget, bvalidation = validated_spec(bcfg)
    console.print("option and baseline paired in time: both servers up together, blocks of first-seen prompts "
                  f"in ABBA order ({prepared.plan.repetitions} block(s) per level)")
    with _measured_run(bcfg, bv, btarget, bvalidation, key, prepared) as (brun, bm, buploads), \
            _measured_run(cfg, v, target, validation, key, prepared) as (run, m, uploads):
        arms = (Arm(m, v, target, validation), Arm(bm, bv, btarget, bvalidation))
        bm.tags["specws.paired_option_run_id"] = run.id
        try:
            try:
                measure_interleaved(arms, cfg, prepared)
            finally:
                for arm in arms:
                    arm.close()
                export(brun.client, brun.id, bm, buploads)   # first: the option's comparison reads it back
            baseline = brun.client.get_run(brun.id)
            compare_with_baseline(arms[0], baseline, run.client)
            for arm in (arms[1], arms[0]):
                check_error_share(arm.m.summary, prepared.workload.max_error_share)
        finally:
            export(run.client, run.id, m, uploads)
        _post_run(brun, post_run, None, btarget.engine)
        _post_run(run, post_run, baseline, target.engine)
        buploads.raise_first()
        uploads.raise_first()
    return {"run_id": run.id, "baseline_run_id": brun.id, **m.metrics}


@contextmanager
def _measured_run(cfg: DictConfig, v: RunView, target: Target, validation: Validation | None, key: str,
                  prepared: PreparedWorkload) -> Iterator[tuple[TrackedRun, Measurement, Uploads]]:
    """An open measured run with its launch record and workload logged: (run, its Measurement, its Uploads)."""
    name = v.run.name or f"{v.option}-{v.workload.label}"
    tags = engine_tags(cfg, _version(target, validation)) | {"specws.pair_key": key, "specws.host": _host(cfg, target)}
    with open_run(cfg, "measure", name, tags) as run:
        m = Measurement(out_dir() / f"records-{run.id}.jsonl")
        m.records_path.touch()   # named by every way the run ends, before a request finishes
        console.print(f"MLflow run [bold]{name}[/] ({run.id}) in {cfg.tracking.experiment}; records: {m.records_path}")
        run.client.set_tag(run.id, "specws.records_path", str(m.records_path))
        uploads = Uploads(run.client, run.id, m.records_path)
        export_inputs(uploads, *_launch_record(target))
        _log_workload(run.client, uploads, run.id, cfg, prepared)
        yield run, m, uploads


def _post_run(run, post_run: Sequence[PostRun], baseline, engine: str) -> None:
    for processor in post_run:  # the measurement is logged: what follows must not lose it
        try:
            processor(run.client, run.id, baseline, engine)
        except Exception as exc:  # noqa: BLE001
            reason = f"{processor.__name__}: {type(exc).__name__}: {exc}"
            run.client.set_tag(run.id, "specws.post_run_failed", reason[:5000])
            console.print(f"[yellow]post-run {processor.__name__} failed[/]: {exc}")


def _log_workload(client, uploads: Uploads, run_id: str, cfg: DictConfig, prepared: PreparedWorkload) -> None:
    client.set_tag(run_id, "specws.prompts_digest", prepared.digest)
    uploads.dict(prepared.plan.describe(), "workload_plan.json")
    rows = [{"id": c.id, "category": c.category, "turns": c.num_turns, "source": c.source,
             "text": (c.raw_prompt or "\n---\n".join(c.user_turns))[:2000]} for c in prepared.conversations]
    measured = prepared.measured_ids()
    client.set_tag(run_id, "specws.measured_digest", measured_digest(rows, measured))
    uploads.write("prompt_set.json", lambda: log_prompt_dataset(client, run_id, str(cfg.workload.name),
                                                                str(cfg.workload.prompt_set), rows, prepared.digest,
                                                                measured))


def out_dir() -> Path:
    """The Hydra job's output folder (its own per job), else the cache's runs folder."""
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return paths.cache_dir() / "runs"
