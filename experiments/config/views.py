"""Typed views of the resolved config, built once per run and passed on: the stages downstream read fields of
these dataclasses, never the config as flattened strings. OmegaConf checks the types; `__post_init__` the ranges."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.config.closed import check_composed
from experiments.config.errors import Refused
from experiments.config.overlays import set_by_option


class ConfigError(ValueError):
    """A config value of the wrong type or out of range; the message names the key and what it must be."""


def _positive(section: str, **values: float | None) -> None:
    for key, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{section}.{key} must be > 0, got {value}")


def _seconds_or_auto(key: str, value: Any) -> float | str | None:
    """A number of seconds > 0 (as a float), `auto`, or None."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a number of seconds > 0, auto or null, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, auto or null, got {value}")
    return float(value)


@dataclass(frozen=True)
class WorkloadView:
    name: str
    prompt_set: str
    concurrency: list[int]
    max_tokens: int
    format: str = "auto"
    temperature: float = 0.0
    seed: int = 0
    repetitions: int = 1
    blocks: int = 1                    # disjoint blocks per level and repetition (interleaved timing's unit)
    warmup_requests: int = 0
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0
    level_timeout_s: Any = "auto"      # seconds, `auto` (derived per slice from floor_tok_s) or None: none
    floor_tok_s: float = 1.0
    max_error_share: float = 0.0
    num_prompts: int | None = None
    max_turns: int | None = None
    reuse_prompts: bool = False
    arrival: str = "closed"            # closed | poisson | gamma (open loop: released at drawn arrival times)
    rate: float | None = None          # open loop: requests (conversations) per second
    burstiness: float = 1.0            # gamma's shape, as vllm bench serve --burstiness (1: Poisson)
    arrival_seed: int | None = None    # null: seed
    slo: dict[str, Any] = field(default_factory=dict)   # latency targets (s), applied to the records afterwards

    @property
    def label(self) -> str:
        """The workload as run names give it: its name, with the prompt set when that is another (`grounded-code`,
        `file-question`, `mixed-chat+code+6more`)."""
        sets = [Path(p.strip()).stem for p in str(self.prompt_set).split(",") if p.strip()]
        named = "+".join(sets if len(sets) <= 3 else [*sets[:2], f"{len(sets) - 2}more"])
        return self.name if named in ("", self.name) else f"{self.name}-{named}"

    def __post_init__(self) -> None:
        _positive("workload", max_tokens=self.max_tokens, repetitions=self.repetitions, blocks=self.blocks,
                  request_timeout_s=self.request_timeout_s, stall_timeout_s=self.stall_timeout_s,
                  floor_tok_s=self.floor_tok_s, num_prompts=self.num_prompts, max_turns=self.max_turns)
        object.__setattr__(self, "level_timeout_s", _seconds_or_auto("workload.level_timeout_s", self.level_timeout_s))
        if not 0.0 <= self.max_error_share <= 1.0:
            raise ConfigError(f"workload.max_error_share must be within [0, 1], got {self.max_error_share}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"workload.concurrency must be a list of levels >= 1, got {self.concurrency}")
        if self.temperature < 0:
            raise ConfigError(f"workload.temperature must be >= 0, got {self.temperature}")
        if self.warmup_requests < 0:
            raise ConfigError(f"workload.warmup_requests must be >= 0, got {self.warmup_requests}")
        _check_arrival(self)

    @property
    def open_loop(self) -> bool:
        return self.arrival != "closed"

    @property
    def arrival_seed_used(self) -> int:
        return self.seed if self.arrival_seed is None else self.arrival_seed


ARRIVALS = ("closed", "poisson", "gamma")
SEED_RANGE = 2 ** 32      # numpy's legacy seeding (vllm bench serve --seed) takes 0 .. 2**32 - 1


def _check_arrival(w: WorkloadView) -> None:
    """Open loop needs a finite rate and one concurrency cap; closed loop takes no arrival settings."""
    if w.arrival not in ARRIVALS:
        raise ConfigError(f"workload.arrival must be closed, poisson or gamma, got {w.arrival!r}")
    if not 0 <= w.arrival_seed_used < SEED_RANGE:
        key = "workload.seed" if w.arrival_seed is None else "workload.arrival_seed"
        raise ConfigError(f"{key} must be within [0, 2**32) to seed the arrivals, got {w.arrival_seed_used}")
    if not w.burstiness > 0:
        raise ConfigError(f"workload.burstiness must be > 0 (gamma's shape), got {w.burstiness}")
    if not w.open_loop:
        pairs = (("rate", w.rate), ("arrival_seed", w.arrival_seed))
        given = [f"workload.{k}={v:g}" for k, v in pairs if v is not None]
        given += [f"workload.burstiness={w.burstiness:g}"] if w.burstiness != 1.0 else []
        if given:
            raise ConfigError(f"open-loop settings given ({', '.join(given)}) while workload.arrival is closed (each "
                              "level keeps `concurrency` requests in flight): set workload.arrival=poisson or gamma, "
                              "or leave them out")
        return
    if w.rate is None or not 0 < w.rate < math.inf:
        raise ConfigError(f"workload.arrival={w.arrival} needs workload.rate, a finite number of requests/s > 0, got "
                          f"{w.rate}; an unlimited rate is the closed loop (workload.arrival=closed)")
    if w.arrival == "poisson" and w.burstiness != 1.0:
        raise ConfigError(f"workload.arrival=poisson has burstiness 1, got workload.burstiness={w.burstiness}: use "
                          "workload.arrival=gamma for another shape")
    if len(w.concurrency) != 1:
        raise ConfigError(f"workload.arrival={w.arrival} takes one concurrency cap (at most that many requests in "
                          f"flight, as vllm bench serve --max-concurrency), got workload.concurrency={w.concurrency}: "
                          "set workload.concurrency=N, and sweep rates with -m workload.rate=1,2,4")


@dataclass(frozen=True)
class SpecView:
    method: str = "none"
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    draft_model: str | None = None
    moe_expert_budget: int | None = None
    moe_telemetry: bool = False          # option E: + the expert_telemetry patch
    moe_telemetry_dir: str | None = None
    ngram: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in ("none", "ngram", "eagle3"):
            raise ConfigError(f"spec.method must be none, ngram or eagle3, got {self.method!r}")
        _positive("spec", num_steps=self.num_steps, topk=self.topk, num_draft_tokens=self.num_draft_tokens,
                  moe_expert_budget=self.moe_expert_budget)

    @property
    def speculative(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class SiteView:
    name: str
    accelerator: str
    engines: list[str]
    engine_args: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    patches_forced: list[str] = field(default_factory=list)   # applied whatever their conditions say
    gpus: int | None = 1
    nvlink: bool | None = None           # false: PCIe only (no NVLink multicast to switch off)


@dataclass(frozen=True)
class ModelView:
    """What the engine is told about the served model."""
    name: str
    path: str
    max_model_len: int | None = None
    trust_remote_code: bool = False
    embedded: bool = False               # shipped in a PyPI package (bin/setup fetches it)
    hf_id: str | None = None
    moe: dict[str, Any] = field(default_factory=dict)   # routed experts, router skew, expert budget

    def __post_init__(self) -> None:
        _positive("model", max_model_len=self.max_model_len)

    @property
    def router_skew(self) -> float | None:
        """`model.moe.router_skew`: the synthetic router's popularity skew (random weights only)."""
        value = self.moe.get("router_skew")
        return None if value is None else float(value)


@dataclass(frozen=True)
class EngineView:
    """How the engine's server is started: its interpreter, entry module and the flags given as they are."""
    name: str
    python: str
    module: str
    health_path: str = "/health"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptionView:
    """The chosen option (conf/option/<name>.yaml `option`): what it needs and where else it runs."""
    name: str
    title: str = ""
    engine: str | None = None            # the engine it needs (the site must have it)
    alternative: str | None = None       # the option running the same drafter on another engine
    offline: str | None = None           # how it runs offline where its engine is missing
    patches: list[str] = field(default_factory=list)
    evaluate_as: str | None = None       # an option that trains its head, then is measured as this one


@dataclass(frozen=True)
class LimitsView:
    max_running_requests: int | None = None

    def __post_init__(self) -> None:
        _positive("limits", max_running_requests=self.max_running_requests)


def _http_url(key: str, url: str | None) -> None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"{key} must be an http:// or https:// URL, got {url!r}")


@dataclass(frozen=True)
class ServerView:
    """Where the server comes from: a running one (`url`), else one started (and pooled) by the runner."""
    url: str | None = None
    api_key_env: str | None = None     # the name of the variable holding the servers' API key
    port: int | None = None
    startup_timeout_s: float = 900.0
    reuse: bool = True
    pool_size: int = 2

    def __post_init__(self) -> None:
        _positive("server", startup_timeout_s=self.startup_timeout_s, pool_size=self.pool_size)
        _http_url("server.url", self.url)


@dataclass(frozen=True)
class BaselineView:
    """How an option is paired with its baseline (conf/config.yaml `baseline`)."""
    pair: bool = True
    lookup: bool = True
    max_age_h: float = 12.0
    near_tie_margin: float = 0.25
    loaded_host_share: float = 0.25
    allow_loaded_host: bool = False
    url: str | None = None
    timing: str = "sequential"       # sequential | interleaved (paired in time)

    def __post_init__(self) -> None:
        _positive("baseline", max_age_h=self.max_age_h, loaded_host_share=self.loaded_host_share)
        _http_url("baseline.url", self.url)
        if self.timing not in ("sequential", "interleaved"):
            raise ConfigError(f"baseline.timing must be sequential or interleaved, got {self.timing!r}")


@dataclass(frozen=True)
class RunModeView:
    name: str | None = None
    dry_run: bool = False
    forecast: bool = False
    tags: dict[str, Any] = field(default_factory=dict)   # extra MLflow tags
    forecast_host_band: float | None = 2.0

    def __post_init__(self) -> None:
        if self.forecast_host_band is not None and self.forecast_host_band < 1.0:
            raise ConfigError(f"run.forecast_host_band must be >= 1 (a ratio of decode steps) or null, got "
                              f"{self.forecast_host_band}")


@dataclass(frozen=True)
class TrackingView:
    """Where the run is recorded."""
    uri: str
    experiment: str
    artifact_root: str | None = None


@dataclass(frozen=True)
class RunView:
    """What a run is, typed once at the entry point and passed alone: option, engine, the model, the typed
    sections, the runner it goes to, and the composed config itself (`config`), kept for what is logged as params
    and for the baseline's overlay only."""
    option_view: OptionView
    engine_start: EngineView             # how the engine's server starts
    model: ModelView
    spec: SpecView
    workload: WorkloadView
    site: SiteView
    limits: LimitsView
    tracking: TrackingView
    runner: str = "experiments.harness.pipeline.measure_option"
    server: ServerView = field(default_factory=ServerView)
    baseline: BaselineView = field(default_factory=BaselineView)
    run: RunModeView = field(default_factory=RunModeView)
    config: Any = field(default=None, compare=False, repr=False)

    @property
    def option(self) -> str:
        return self.option_view.name

    @property
    def engine(self) -> str:
        return self.engine_start.name

    @property
    def health_path(self) -> str:
        return self.engine_start.health_path

    def set_by_option(self, knobs: Iterable[str]) -> frozenset[str]:
        """Those of `knobs` (dotted spec keys) that hold exactly the value the option's own yaml gives them."""
        return frozenset(k for k in knobs if self.config is not None and set_by_option(self.config, k))


@dataclass(frozen=True)
class LaunchView:
    """Everything one server launch reads, typed (built by experiments.engines.config.launch_view_of): the engine
    adapters take these parts, never the config."""
    engine: EngineView
    model: ModelView
    spec: SpecView
    limits: LimitsView
    site: str
    site_args: list[str]                 # the site's flags for this engine
    env: dict[str, str]                  # engine.env, then site.env over it
    patches: list[str]                   # the SGLang patches the launcher applies (none for other engines)
    forced_patches: list[str]
    patch_env: dict[str, str]            # what those patches read

    @property
    def given_args(self) -> list[str]:
        """Flags given as they are (the site's and engine.extra_args): a limit flag among them is not pinned again."""
        return [*self.site_args, *self.engine.extra_args]


def _typed(schema: type, node: DictConfig | None, section: str, **fixes: Any):
    """`node`'s keys that `schema` names, type-checked and converted by OmegaConf, then range-checked."""
    try:
        data = OmegaConf.to_container(node, resolve=True) if node is not None else {}
        picked = {f.name: data[f.name] for f in fields(schema) if f.name in data} | fixes
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), picked))
    except OmegaConfBaseException as exc:
        key = f"{section}.{exc.full_key}" if getattr(exc, "full_key", None) else section
        raise ConfigError(f"{key}: {getattr(exc, 'msg', exc)}".splitlines()[0]) from None


def typed_run(cfg: DictConfig) -> RunView:
    """The composed config checked (every key declared, an option chosen that names its runner) and typed once;
    a bad value is refused naming its key."""
    check_composed(cfg)
    try:
        return views_of(cfg)
    except ConfigError as exc:
        raise Refused(str(exc)) from None


def views_of(cfg: DictConfig) -> RunView:
    """All views of `cfg`; raises ConfigError naming the first bad value."""
    levels = OmegaConf.select(cfg, "workload.concurrency")
    levels = list(levels) if OmegaConf.is_list(levels) else [levels]
    limits = limits_view(cfg)
    if limits.max_running_requests is not None and max(levels) > limits.max_running_requests:
        raise ConfigError(f"workload.concurrency level {max(levels)} is above the engine limit "
                          f"limits.max_running_requests={limits.max_running_requests} (the site's deployment value): "
                          "it would only queue in the engine; lower the level or raise the limit")
    return RunView(option_view=_typed(OptionView, cfg.option, "option"), engine_start=engine_view(cfg),
                   model=model_view(cfg),
                   spec=_typed(SpecView, cfg.spec, "spec"),
                   workload=_typed(WorkloadView, cfg.workload, "workload", concurrency=levels),
                   site=_typed(SiteView, cfg.site, "site"),
                   limits=limits, tracking=tracking_view(cfg),
                   runner=str(OmegaConf.select(cfg, "option.runner._target_", default=RunView.runner)),
                   config=cfg,
                   server=_typed(ServerView, cfg.get("server"), "server"),
                   baseline=_typed(BaselineView, cfg.get("baseline"), "baseline"),
                   run=_typed(RunModeView, cfg.get("run"), "run"))


def tracking_view(cfg: DictConfig) -> TrackingView:
    """`cfg.tracking`; an unresolvable URI (tracking=server without MLFLOW_TRACKING_URI) says what to set."""
    try:
        OmegaConf.select(cfg, "tracking.uri", throw_on_resolution_failure=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"tracking.uri cannot be resolved ({str(exc).splitlines()[0]}); set MLFLOW_TRACKING_URI "
                          "for tracking=server, or use tracking=local") from None
    return _typed(TrackingView, cfg.tracking, "tracking")


def spec_view(spec: DictConfig | dict[str, Any] | None) -> SpecView:
    """`spec` (a config node, or a run's spec settings as a dict) as a SpecView; raises ConfigError."""
    node = spec if isinstance(spec, DictConfig) or spec is None else OmegaConf.create(spec)
    return _typed(SpecView, node, "spec")


def model_view(cfg: DictConfig) -> ModelView:
    return _typed(ModelView, cfg.model, "model")


def engine_view(cfg: DictConfig) -> EngineView:
    return _typed(EngineView, cfg.engine, "engine")


def limits_view(cfg: DictConfig) -> LimitsView:
    return _typed(LimitsView, cfg.get("limits"), "limits")
