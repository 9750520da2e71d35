"""The lease plans (bin/kimi-plan, bin/tp8-plan) as they would run, read from their dry run."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterable
from pathlib import Path


def planned_steps(plan: Path, dest: Path, unset: Iterable[str], **env: str) -> dict[str, list[str]]:
    """The plan's steps as it would run them under `dest` (PLAN_DRY_RUN=1: bin/lib/plan.sh prints each
    command line instead of running it): step name -> argv. `unset`: the plan's own variables, dropped from this
    process's environment so that only `env` sets them."""
    base = {k: v for k, v in os.environ.items() if k not in set(unset)}
    out = subprocess.run(["bash", str(plan)], env={**base, "SPECWS_DEST": str(dest), "OUT": str(dest / "out"),
                                                   "PLAN_DRY_RUN": "1", **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {m[1]: shlex.split(m[2]) for m in re.finditer(r"^== dry-run (\S+): (.*)$", out, re.M)}
