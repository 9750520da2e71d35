"""What the typed run says about its engine: which one, its site flags, the SGLang patches it applies and the run
tags that record them. Outside the adapters, the only place that reads the engine's name."""
from __future__ import annotations

from experiments.config.views import LaunchView, RunView
from experiments.engines import adapter_for
from experiments.engines.base import EngineAdapter


def adapter_of(run: RunView) -> EngineAdapter:
    return adapter_for(run.engine)


def site_args(run: RunView) -> list[str]:
    """The site's flags for this engine (conf/site/<site>.yaml `engine_args.<engine>`)."""
    return [str(a) for a in run.site.engine_args.get(run.engine) or []]


def given_args(run: RunView) -> list[str]:
    """The flags given as they are: the site's, then engine.extra_args."""
    return [*site_args(run), *(str(a) for a in run.engine_start.extra_args)]


def server_env(run: RunView) -> dict[str, str]:
    """The engine server's environment: engine.env, then site.env over it."""
    return {str(k): str(v) for k, v in {**run.engine_start.env, **run.site.env}.items()}


def available_on_site(run: RunView) -> bool:
    return run.engine in run.site.engines


def sglang_patches_for(run: RunView) -> list[str]:
    """The patches the launcher applies: synthetic_router when the model names a router skew (random weights),
    the site's, then the option's (E: moe_budget), then expert_telemetry when spec.moe_telemetry is on (after
    moe_budget, so that it counts the budgeted experts); none for an engine other than SGLang."""
    if not adapter_of(run).patchable:
        return []
    router = ["synthetic_router"] if run.model.router_skew is not None else []
    names = [*router, *run.site.patches, *run.option_view.patches,
             *(["expert_telemetry"] if run.spec.moe_telemetry else [])]
    return list(dict.fromkeys(str(n) for n in names))


def forced_patches(run: RunView) -> list[str]:
    """Patches applied whatever their conditions say (`site.patches_forced`): e.g. the SM 12.x INT4 kernel swap
    forced on an sm_90 host to measure it there. Each must also be requested."""
    return [str(n) for n in run.site.patches_forced] if adapter_of(run).patchable else []


def patch_env(run: RunView, patches: list[str]) -> dict[str, str]:
    """What the named patches read: the expert budget B (moe_budget), the telemetry folder (expert_telemetry),
    the router skew (synthetic_router)."""
    from sglang_patches.expert_telemetry import DIR_ENV
    from sglang_patches.moe_budget import BUDGET_ENV
    from sglang_patches.synthetic_router import SKEW_ENV
    env = {BUDGET_ENV: str(run.spec.moe_expert_budget)} if "moe_budget" in patches else {}
    env |= {SKEW_ENV: str(run.model.router_skew)} if "synthetic_router" in patches else {}
    return env | ({DIR_ENV: str(run.spec.moe_telemetry_dir)} if "expert_telemetry" in patches else {})


def launch_view_of(run: RunView) -> LaunchView:
    """What one server launch reads: the adapters build the command line and environment from it."""
    patches = sglang_patches_for(run)
    return LaunchView(engine=run.engine_start, model=run.model, spec=run.spec, limits=run.limits, site=run.site.name,
                      site_args=site_args(run), env=server_env(run), patches=patches,
                      forced_patches=forced_patches(run), patch_env=patch_env(run, patches))


def moe_budget_tags(run: RunView, patches: list[str]) -> dict[str, str]:
    """Option E: the expert budget B the server ran with; B >= the model's routed experts is unbudgeted."""
    if "moe_budget" not in patches:
        return {}
    budget, experts = run.spec.moe_expert_budget, run.model.moe.get("num_experts")
    unbudgeted = "unknown" if experts is None else str(int(budget) >= int(experts)).lower()
    return {"specws.moe_expert_budget": str(budget), "specws.moe_num_experts": str(experts),
            "specws.moe_unbudgeted": unbudgeted}


def engine_tags(run: RunView, engine_version: str) -> dict[str, str]:
    """The engine, its release and the patches requested; `sglang_patches.applied` is replaced by the launcher's
    report once the server has started (harness.measure)."""
    requested = sglang_patches_for(run)
    sglang = adapter_of(run).patchable
    return moe_budget_tags(run, requested) | {
        "specws.engine": run.engine, "specws.engine_version": engine_version,
        "sglang_patches.requested": ",".join(requested) or "none",
        "sglang_patches.forced": ",".join(forced_patches(run)) or "none",
        "sglang_patches.applied": "no launcher report yet" if sglang else "none"}
