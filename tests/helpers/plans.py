"""The lease plans (bin/kimi-plan, bin/tp8-plan, bin/load-plan, bin/probe) as they would run, read from their dry
run, and what their dry runs need: a carried work tree, SGLang 0.5.14's parser, a clean environment."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from experiments.config.paths import ROOT, cache_dir
from experiments.tracking.offline_store import OfflineClient

SGLANG_0_5_14 = cache_dir() / "sglang-0.5.14"
# what would point a plan's runs elsewhere (or write conf/local/)
PLAN_VARIABLES = ("OUT", "SPECWS_SITE", "SPECWS_DEST", "PYTHONPATH", "SGLANG_PYTHON", "PROBE_EAGLE", "PROBE_FIT",
                  "LOAD_OVERRIDES", "LOAD_RATES", "PLAN_BUDGET_S")


def planned_steps(plan: Path, dest: Path, unset: Iterable[str], **env: str) -> dict[str, list[str]]:
    """The plan's steps as it would run them under `dest` (PLAN_DRY_RUN=1: bin/lib/plan.sh prints each
    command line instead of running it): step name -> argv. `unset`: the plan's own variables, dropped from this
    process's environment so that only `env` sets them."""
    base = {k: v for k, v in os.environ.items() if k not in set(unset)}
    out = subprocess.run(["bash", str(plan)], env={**base, "SPECWS_DEST": str(dest), "OUT": str(dest / "out"),
                                                   "PLAN_DRY_RUN": "1", **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {m[1]: shlex.split(m[2]) for m in re.finditer(r"^== dry-run (\S+): (.*)$", out, re.M)}


def dry_runs(root: Path) -> list:
    """The dry-run runs of an offline store (a multirun adds its parent run, which is no dry run)."""
    client = OfflineClient(root)
    runs = [client.get_run(i) for i in client.run_ids()]
    return [r for r in runs if r.data.tags.get("specws.mode") == "dry_run"]


def sglang_0_5_14(folder: Path) -> str:
    """An interpreter that imports SGLang 0.5.14 (bin/setup's overlay first on its path), as python3 with the
    bundle does on the H200 host; only the engine's parser runs in it."""
    if not (SGLANG_0_5_14 / "sglang-0.5.14.dist-info").is_dir():
        pytest.fail(f"SGLang 0.5.14 overlay missing ({SGLANG_0_5_14}); run bin/setup")
    wrapper = folder / "sglang-0.5.14-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={SGLANG_0_5_14} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables that would point the runs elsewhere (or write conf/local/)."""
    env = {k: v for k, v in os.environ.items() if k not in PLAN_VARIABLES}
    return env | extra


def carried_tree(dest: Path) -> Path:
    """A copy of what a device call carries: the tracked files and the untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def host_stage(tmp_path: Path, model: Path, **env: str) -> tuple[Path, Path, dict[str, str]]:
    """(the carried work tree, the bundle's folder, the environment) of a `bin/h200 <stage>` call as the H200 host
    makes it: `model` as `bin/h200 install` converts it there, the host's python3 (this interpreter), SGLang
    0.5.14's parser, and `env` added."""
    tree = carried_tree(tmp_path / "tree")
    dest = tmp_path / "dest"
    (dest / "cache" / "models").mkdir(parents=True)
    (dest / "cache" / "models" / model.name).symlink_to(model)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python3").chmod(0o755)
    return tree, dest, clean_env(SPECWS_DEST=str(dest), SGLANG_PYTHON=sglang_0_5_14(tmp_path),
                                 PATH=f"{bindir}:{os.environ['PATH']}", **env)
