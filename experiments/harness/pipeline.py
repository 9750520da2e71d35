"""The runner of every option that is one measurement (`option.runner` in conf/option/*.yaml). The option is armed
first: its command line validated by the engine's own parser (or, with `server.url`, a running server's settings
read back from it) and its pairing key fixed. Then one mode, one function each (MODES):
- `dry_run`: a run that records the launch spec and the workload plan;
- `forecast` (`run.forecast=true`): the paired baseline, then a forecast run filled in by the forecaster the entry
  point hands in; no option server starts;
- `sequential`: the paired baseline, found in the store or measured first, then the option;
- `interleaved` (`baseline.timing=interleaved`): the option and a fresh baseline paired in time.
Every runner takes (RunView, PreparedWorkload, Hooks)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hydra.core.hydra_config import HydraConfig

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


def validated_spec(run: RunView) -> tuple[LaunchSpec, Validation]:
    """The launch spec, checked once per command line by the engine's own parser."""
    spec = build_launch_spec(run)
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


@dataclass(frozen=True)
class Hooks:
    """What the entry point hands every runner: the analysis run after each measured run, and the forecaster of
    `run.forecast=true` (None otherwise)."""
    post_run: Sequence[PostRun] = ()
    forecaster: Forecaster | None = None


@dataclass(frozen=True)
class Arming:
    """One side of a comparison, resolved before anything is measured: its typed run, the server it measures
    (launched here, or a running one), the engine's validation of the command line (None for a running server)
    and the pairing key both sides share."""
    run: RunView
    target: Target
    validation: Validation | None
    key: str

    @property
    def version(self) -> str:
        return self.target.version if isinstance(self.target, Served) else self.validation.version


def measure_option(run: RunView, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """The option resolved (its command line validated, or its running server read back), then one of the modes:
    a dry run, a forecast, a pair in time, or the paired baseline (found or measured) and then the option."""
    option = _arm_option(run, prepared)
    return MODES[_mode(option)](option, prepared, hooks)


def _arm_option(v: RunView, prepared: PreparedWorkload) -> Arming:
    if v.server.url:
        if v.run.forecast:
            raise Refused("run.forecast=true starts no option server, so there is none to attach: leave server.url "
                          "unset (baseline.url measures a running baseline)")
        served = attached(v, v.server.url, None if v.run.dry_run else prepared)
        return Arming(v, served, None, served_pair_key(v, served, prepared.digest))
    if v.run.dry_run:   # only the command line is validated (the box's, from here), in the engine's interpreter
        check_engine_env(v)
    else:
        check_assets(v)
    spec, validation = validated_spec(v)
    return Arming(v, spec, validation, pair_key(v, validation.version, prepared.digest))


def _mode(option: Arming) -> str:
    v = option.run
    if v.run.dry_run:
        return "dry_run"
    if v.run.forecast:
        return "forecast"
    return "interleaved" if _interleaved(v, option.target) else "sequential"


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


def _host(option: Arming) -> str:
    """Where a run was measured, for the drift check of a stored baseline: this machine and engine environment,
    or the host of a running server's URL."""
    if isinstance(option.target, Served):
        return f"attached:{urlsplit(option.target.url).hostname}/{option.run.site.accelerator}"
    return host_fingerprint(option.run)


def dry_run(option: Arming, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """A run that records the launch spec (or the running server's account) and the workload plan."""
    v, target = option.run, option.target
    with open_run(v, "dry_run", v.run.name or f"{v.option}-plan",
                  engine_tags(v, option.version) | {"specws.pair_key": option.key}) as run:
        uploads = Uploads(run.client, run.id)
        export_inputs(uploads, *_launch_record(target))
        uploads.dict(prepared.plan.describe(), "workload_plan.json")
        uploads.raise_first()
    if isinstance(target, Served):
        console.print(f"read back from {target.engine} {option.version} at {target.url}: {len(target.settings)} "
                      f"settings ({', '.join(target.sources)}), speculation {target.speculation}")
    else:
        console.print(f"validated by {target.engine} {option.version}: {redact_text(' '.join(target.argv))}")
    console.print(f"workload {v.workload.name}: {prepared.plan.describe()}")
    return {"run_id": run.id}


def _launch_record(target: Target) -> tuple[dict, str]:
    """The launch spec, or the running server's own account of itself, as recorded."""
    return (target.to_dict(), "served_server.json") if isinstance(target, Served) else \
        (target.to_dict(), "launch_spec.json")


def forecast(option: Arming, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """The paired baseline (found or measured), then a forecast run of the option against it; no option server."""
    v = option.run
    if hooks.forecaster is None or not v.baseline.pair or not v.spec.speculative:
        raise InvalidLaunch("run.forecast=true needs a speculative option paired with a baseline "
                            "(baseline.pair=true) and a forecaster")
    baseline = paired_baseline(option, prepared, hooks)
    tags = engine_tags(v, option.version) | {"specws.pair_key": option.key,
                                             "specws.baseline_run_id": baseline.info.run_id}
    params = flatten(v.config)
    with open_run(v, "forecast", v.run.name or f"{v.option}-{v.workload.label}-forecast", tags,
                  params) as run:
        for line in hooks.forecaster(run.client, run.id, baseline, params):
            console.print(line)
    return {"run_id": run.id, "baseline_run_id": baseline.info.run_id}


def sequential(option: Arming, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """The paired baseline (found in the store, or measured first), then the option against it."""
    baseline = paired_baseline(option, prepared, hooks) if option.run.baseline.pair else None
    return record_measured(option, baseline, prepared, hooks)


def paired_baseline(option: Arming, prepared: PreparedWorkload, hooks: Hooks):
    """A stored baseline that matches (same key and host, recent, no failed request, not measured on a loaded
    host), else a fresh one measured now on the same engine and limits (`_arm_baseline`)."""
    client, exp_id = setup(option.run.tracking)
    found = _stored_baseline(client, exp_id, option) if option.run.baseline.lookup else None
    if found is not None:
        return found
    base = _arm_baseline(option, prepared)
    console.print("no matching baseline in the store (same key and host, recent, no failed request): "
                  "measuring one first")
    return client.get_run(record_measured(base, None, prepared, hooks)["run_id"])


def _baseline_run(option: Arming) -> RunView:
    """The option's run with conf/option/baseline.yaml laid over it."""
    bcfg = with_option(option.run.config, "baseline")
    bcfg.run.name = f"baseline-{option.run.workload.label}"
    return views_of(bcfg)


def _arm_baseline(option: Arming, prepared: PreparedWorkload) -> Arming:
    """The baseline's side: launched here with the option's flags less speculation, or the running server of
    `baseline.url`, whose settings must be the option's."""
    bv = _baseline_run(option)
    if option.run.baseline.url:
        return _attached_baseline(option, bv, prepared)
    if isinstance(option.target, Served):
        raise Refused(f"no stored baseline matches the server at {option.target.url} (pairing key {option.key}); give "
                      "the running baseline server as baseline.url, or set baseline.pair=false")
    spec, validation = validated_spec(bv)
    return Arming(bv, spec, validation, option.key)


def _stored_baseline(client, exp_id: str, option: Arming):
    host, b = _host(option), option.run.baseline
    found = find_baseline(client, exp_id, option.key, host, b.max_age_h, b.allow_loaded_host)
    if found is not None:
        console.print(f"paired with baseline run {found.info.run_id}")
    elif not b.allow_loaded_host and (loaded := find_baseline(client, exp_id, option.key, host, b.max_age_h,
                                                              True)) is not None:
        console.print(f"stored baseline run {loaded.info.run_id} matches but was measured while other processes kept "
                      "the host busy (specws.host_loaded): not reused; baseline.allow_loaded_host=true reuses it")
    return found


def _attached_baseline(option: Arming, bv: RunView, prepared: PreparedWorkload) -> Arming:
    """The running baseline server of `baseline.url`: refused unless it is the option's server in everything
    but speculation (both read back from the servers)."""
    target, url = option.target, option.run.baseline.url
    if not isinstance(target, Served):
        raise Refused("baseline.url pairs a running baseline with a running option server: give the option's as "
                      "server.url, or leave baseline.url unset to launch the baseline")
    served = attached(bv, url, prepared)
    if served_pair_key(bv, served, prepared.digest) != option.key:
        differ = settings_mismatch(target.settings, served.settings)
        if target.version != served.version:
            differ.insert(0, f"engine version: {target.version} vs {served.version}")
        raise PairingRefused(f"the baseline server at {url} differs from the option's at {target.url} in more than "
                             f"speculation: {'; '.join(differ[:20]) or 'settings one of them does not report'}")
    return Arming(bv, served, None, option.key)


def record_measured(side: Arming, baseline, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """One measured MLflow run, ended FINISHED / FAILED / KILLED by the one run lifecycle. The measurement is
    exported on every way out, metrics before any artifact; an artifact that could not be written fails the run
    last, with the first such error."""
    with _measured_run(side, prepared) as (run, m, uploads):
        try:
            measure(m, side.run, side.target, baseline, prepared, side.validation, run.client)
        finally:
            export(run.client, run.id, m, uploads)
        _post_run(run, hooks.post_run, baseline, side.target.engine)
        uploads.raise_first()
    return {"run_id": run.id, **m.metrics}


def interleaved(option: Arming, prepared: PreparedWorkload, hooks: Hooks) -> dict:
    """Option and a fresh baseline paired in time (baseline.timing=interleaved): both servers up together, each
    block of first-seen prompts sent to one and then the other (ABBA), two runs open at once. The baseline's
    measurement is exported first, then the option is compared with it; both are exported on every way out."""
    base = _arm_baseline(option, prepared)
    console.print("option and baseline paired in time: both servers up together, blocks of first-seen prompts "
                  f"in ABBA order ({prepared.plan.repetitions} block(s) per level)")
    with _measured_run(base, prepared) as (brun, bm, buploads), \
            _measured_run(option, prepared) as (run, m, uploads):
        arms = (Arm(m, option.run, option.target, option.validation),
                Arm(bm, base.run, base.target, base.validation))
        bm.tags["specws.paired_option_run_id"] = run.id
        try:
            try:
                measure_interleaved(arms, prepared)
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
        _post_run(brun, hooks.post_run, None, base.target.engine)
        _post_run(run, hooks.post_run, baseline, option.target.engine)
        buploads.raise_first()
        uploads.raise_first()
    return {"run_id": run.id, "baseline_run_id": brun.id, **m.metrics}


MODES: dict[str, Callable[[Arming, PreparedWorkload, Hooks], dict]] = {
    "dry_run": dry_run, "forecast": forecast, "interleaved": interleaved, "sequential": sequential}


@contextmanager
def _measured_run(side: Arming, prepared: PreparedWorkload) -> Iterator[tuple[TrackedRun, Measurement, Uploads]]:
    """An open measured run with its launch record and workload logged: (run, its Measurement, its Uploads)."""
    v = side.run
    name = v.run.name or f"{v.option}-{v.workload.label}"
    tags = engine_tags(v, side.version) | {"specws.pair_key": side.key, "specws.host": _host(side)}
    with open_run(v, "measure", name, tags) as run:
        m = Measurement(out_dir() / f"records-{run.id}.jsonl")
        m.records_path.touch()   # named by every way the run ends, before a request finishes
        console.print(f"MLflow run [bold]{name}[/] ({run.id}) in {v.tracking.experiment}; records: {m.records_path}")
        run.client.set_tag(run.id, "specws.records_path", str(m.records_path))
        uploads = Uploads(run.client, run.id, m.records_path)
        export_inputs(uploads, *_launch_record(side.target))
        _log_workload(run.client, uploads, run.id, v, prepared)
        yield run, m, uploads


def _post_run(run, post_run: Sequence[PostRun], baseline, engine: str) -> None:
    for processor in post_run:  # the measurement is logged: what follows must not lose it
        try:
            processor(run.client, run.id, baseline, engine)
        except Exception as exc:  # noqa: BLE001
            reason = f"{processor.__name__}: {type(exc).__name__}: {exc}"
            run.client.set_tag(run.id, "specws.post_run_failed", reason[:5000])
            console.print(f"[yellow]post-run {processor.__name__} failed[/]: {exc}")


def _log_workload(client, uploads: Uploads, run_id: str, v: RunView, prepared: PreparedWorkload) -> None:
    client.set_tag(run_id, "specws.prompts_digest", prepared.digest)
    uploads.dict(prepared.plan.describe(), "workload_plan.json")
    rows = [{"id": c.id, "category": c.category, "turns": c.num_turns, "source": c.source,
             "text": (c.raw_prompt or "\n---\n".join(c.user_turns))[:2000]} for c in prepared.conversations]
    measured = prepared.measured_ids()
    client.set_tag(run_id, "specws.measured_digest", measured_digest(rows, measured))
    uploads.write("prompt_set.json", lambda: log_prompt_dataset(client, run_id, v.workload.name,
                                                                v.workload.prompt_set, rows, prepared.digest,
                                                                measured))


def out_dir() -> Path:
    """The Hydra job's output folder (its own per job), else the cache's runs folder."""
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return paths.cache_dir() / "runs"
