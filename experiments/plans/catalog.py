"""Every plan by name, as `python -m experiments.plans NAME` and the tests find them."""
from __future__ import annotations

from experiments.plans import d, h200, kimi, load, probe, tp8
from experiments.plans.plan import Plan

PLANS: dict[str, Plan] = {p.name: p for p in (kimi.PLAN, tp8.PLAN, load.PLAN, d.PLAN, probe.PLAN, h200.MEASURE,
                                                h200.STANDARD, h200.PAIRS)}
