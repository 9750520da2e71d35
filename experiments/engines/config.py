"""What the composed config says about its engine: which one, its site flags, the SGLang patches it applies and
the run tags that record them. Outside the adapters, the only place that reads the engine's name."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from experiments.config.views import LaunchView, engine_view, limits_view, model_view, spec_view
from experiments.engines import adapter_for
from experiments.engines.base import EngineAdapter


def engine_name(cfg: DictConfig) -> str:
    return str(cfg.engine.name)


def adapter_of(cfg: DictConfig) -> EngineAdapter:
    return adapter_for(engine_name(cfg))


def site_args(cfg: DictConfig) -> list[str]:
    """The site's flags for this engine (conf/site/<site>.yaml `engine_args.<engine>`)."""
    return [str(a) for a in cfg.site.engine_args.get(engine_name(cfg)) or []]


def server_env(cfg: DictConfig) -> dict[str, str]:
    """The engine server's environment from the config: engine.env, then site.env over it."""
    env = {**(OmegaConf.to_container(cfg.engine.env, resolve=True) or {}),
           **(OmegaConf.to_container(cfg.site.env, resolve=True) or {})}
    return {str(k): str(v) for k, v in env.items()}


def available_on_site(cfg: DictConfig) -> bool:
    return engine_name(cfg) in list(cfg.site.engines)


def sglang_patches_for(cfg: DictConfig) -> list[str]:
    """The patches the launcher applies: synthetic_router when the model names a router skew (random weights),
    the site's, then the option's (E: moe_budget), then expert_telemetry when spec.moe_telemetry is on (after
    moe_budget, so that it counts the budgeted experts); none for an engine other than SGLang."""
    if not adapter_of(cfg).patchable:
        return []
    option = cfg.option.get("patches") if cfg.get("option") else None
    router = ["synthetic_router"] if router_skew(cfg) is not None else []
    names = [*router, *cfg.site.patches, *(option or []),
             *(["expert_telemetry"] if cfg.spec.get("moe_telemetry") else [])]
    return list(dict.fromkeys(str(n) for n in names))


def router_skew(cfg: DictConfig) -> float | None:
    """`model.moe.router_skew`: the synthetic router's popularity skew for a model served with random weights."""
    value = OmegaConf.select(cfg, "model.moe.router_skew")
    return None if value is None else float(value)


def forced_patches(cfg: DictConfig) -> list[str]:
    """Patches applied whatever their conditions say (`site.patches_forced`): e.g. the SM 12.x INT4 kernel swap
    forced on an sm_90 host to measure it there. Each must also be requested."""
    return [str(n) for n in (cfg.site.get("patches_forced") or [])] if adapter_of(cfg).patchable else []


def patch_env(cfg: DictConfig, patches: list[str]) -> dict[str, str]:
    """What the named patches read: the expert budget B (moe_budget), the telemetry folder (expert_telemetry),
    the router skew (synthetic_router)."""
    from sglang_patches.expert_telemetry import DIR_ENV
    from sglang_patches.moe_budget import BUDGET_ENV
    from sglang_patches.synthetic_router import SKEW_ENV
    env = {BUDGET_ENV: str(cfg.spec.moe_expert_budget)} if "moe_budget" in patches else {}
    env |= {SKEW_ENV: str(router_skew(cfg))} if "synthetic_router" in patches else {}
    return env | ({DIR_ENV: str(cfg.spec.moe_telemetry_dir)} if "expert_telemetry" in patches else {})


def launch_view_of(cfg: DictConfig) -> LaunchView:
    """What one server launch reads, typed once: the adapters build the command line and environment from it.
    Raises ConfigError naming a bad value."""
    patches = sglang_patches_for(cfg)
    return LaunchView(engine=engine_view(cfg), model=model_view(cfg), spec=spec_view(cfg.spec),
                      limits=limits_view(cfg), site=str(cfg.site.name), site_args=site_args(cfg),
                      env=server_env(cfg), patches=patches, forced_patches=forced_patches(cfg),
                      patch_env=patch_env(cfg, patches))


def moe_budget_tags(cfg: DictConfig, patches: list[str]) -> dict[str, str]:
    """Option E: the expert budget B the server ran with; B >= the model's routed experts is unbudgeted."""
    if "moe_budget" not in patches:
        return {}
    budget, experts = cfg.spec.moe_expert_budget, OmegaConf.select(cfg, "model.moe.num_experts")
    unbudgeted = "unknown" if experts is None else str(int(budget) >= int(experts)).lower()
    return {"specws.moe_expert_budget": str(budget), "specws.moe_num_experts": str(experts),
            "specws.moe_unbudgeted": unbudgeted}


def engine_tags(cfg: DictConfig, engine_version: str) -> dict[str, str]:
    """The engine, its release and the patches requested; `sglang_patches.applied` is replaced by the launcher's
    report once the server has started (harness.measure)."""
    requested = sglang_patches_for(cfg)
    sglang = adapter_of(cfg).patchable
    return moe_budget_tags(cfg, requested) | {
        "specws.engine": engine_name(cfg), "specws.engine_version": engine_version,
        "sglang_patches.requested": ",".join(requested) or "none",
        "sglang_patches.forced": ",".join(forced_patches(cfg)) or "none",
        "sglang_patches.applied": "no launcher report yet" if sglang else "none"}
