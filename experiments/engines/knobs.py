"""No silent drops: a spec setting the chosen engine, method and release will not use is refused before launch
(dry runs included), naming it. Called by preflight.check_option."""
from __future__ import annotations

from experiments.config.errors import Refused
from experiments.config.views import RunView
from experiments.engines import adapter_for


def refuse_unused_knobs(run: RunView) -> None:
    """Raise Refused naming every spec setting a user gave that the engine would ignore. Settings the option
    overlay itself makes (e.g. option E's EAGLE steps when the model drafts with NGRAM) are the option's, not the
    user's (`RunView.set_by_option`): they are left to the option (and still listed by EngineAdapter.unused_knobs)."""
    from experiments.engines.config import sglang_patches_for

    reasons = adapter_for(run.engine).unused_knob_reasons(run.spec, sglang_patches_for(run))
    owned = run.set_by_option(reasons)
    users = [why for knob, why in reasons.items() if knob not in owned]
    if users:
        raise Refused(f"{run.engine} would not use these settings: " + "; ".join(users))
