"""python -m experiments.plans NAME [--dry-run] [--mark-done] [--check] [key=value ...] [-- OVERRIDES ...]: one plan
on this host ($SPECWS_DEST, $OUT), its knobs as keys (`--help` after NAME lists them with their defaults); Hydra
overrides after `--` go to its runs. An unknown key or a bad value is refused before anything runs (exit status 2);
--check stops there. --mark-done touches $SPECWS_DEST/plan.done at the end where the plan does not."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from experiments.plans.catalog import PLANS
from experiments.plans.host import Host
from experiments.plans.plan import Plan, run_plan
from experiments.plans.settings import KnobError, describe, parse_knobs

FLAGS = ("--dry-run", "--mark-done", "--check")


def usage() -> str:
    return f"usage: python -m experiments.plans {{{','.join(PLANS)}}} [--dry-run] [key=value ...] [-- OVERRIDES ...]"


def keys(plan: Plan) -> str:
    """Each key of the plan with its default."""
    return "\n".join(f"  {f.name}={describe_default(f)}" for f in dataclasses.fields(plan.settings))


def describe_default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()   # type: ignore[misc]
    return " ".join(value) if isinstance(value, tuple) else str(value)


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in PLANS:
        print(usage(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    plan, args = PLANS[argv[0]], list(argv[1:])
    head = args[:args.index("--")] if "--" in args else args
    if "-h" in head or "--help" in head:
        print(f"{usage()}\n{plan.name}'s keys and their defaults:\n{keys(plan)}")
        return 0
    flags = {f for f in FLAGS if f in head}
    args = [a for i, a in enumerate(args) if not (a in FLAGS and i < len(head))]
    try:
        settings = parse_knobs(plan.settings, args)
    except KnobError as e:
        print(f"plans {plan.name}: {e}", file=sys.stderr)
        return 2
    print(f"== plan {plan.name}: {describe(settings)}", flush=True)
    if "--check" in flags:
        return 0
    return run_plan(plan, settings, Host.from_env(), dry_run="--dry-run" in flags, mark_done="--mark-done" in flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
