"""The lease plans (experiments/plans) as they would run, read from a dry run in this process, and what running
them as a host does needs: a carried work tree, SGLang 0.5.14's parser, a clean environment."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config.paths import ROOT, cache_dir
from experiments.plans.catalog import PLANS
from experiments.plans.host import Host
from experiments.plans.plan import planned
from experiments.plans.settings import parse_knobs
from experiments.tracking.offline_store import OfflineClient

SGLANG_0_5_14 = cache_dir() / "sglang-0.5.14"
# the host's environment that would point a plan's runs elsewhere (or write conf/local/)
HOST_VARIABLES = ("OUT", "SPECWS_SITE", "SPECWS_DEST", "SPECWS_DEST_DONE", "PYTHONPATH", "SGLANG_PYTHON", "PYTHON")
PYTHON = re.compile(r"(^|/)python3?$")
# bin/ recipe -> the plan it starts
RECIPES = {"kimi-plan": "kimi", "tp8-plan": "tp8", "load-plan": "load", "d-plan": "d", "probe": "probe"}


def planned_steps(plan: str, dest: Path, *args: str, **knobs: str) -> dict[str, list[str]]:
    """The plan's steps as a dry run under `dest` plans them (the folders $SPECWS_DEST=dest, $OUT=dest/out):
    step name -> argv. args and knobs: its `key=value` settings (args may end with `--` and Hydra overrides)."""
    p = PLANS[plan]
    settings = parse_knobs(p.settings, [*(f"{k}={v}" for k, v in knobs.items()), *args])
    return {name: list(argv) for name, argv in planned(p, settings, Host(dest, dest / "out")).items()}


def started_modules(steps: dict[str, list[str]]) -> set[str]:
    """The modules the steps start with `python3 -m` (also inside a `bash -c` command line)."""
    found = set()
    for argv in steps.values():
        found |= {argv[i + 1] for i in range(1, len(argv) - 1) if argv[i] == "-m" and PYTHON.search(argv[i - 1])}
        found |= {m for a in argv for m in re.findall(r"python3 -m ([\w.]+)", a)}
    return found


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
    env = {k: v for k, v in os.environ.items() if k not in HOST_VARIABLES}
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


def module_answers_help(module: str) -> None:
    """`python -m module --help` exits 0 here (the module exists and its parser builds)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def recipe_dry_run(recipe: str, dest: Path, *args: str) -> str:
    """bin/<recipe> --dry-run ARGS as a host runs it (python3 on PATH), its output."""
    out = subprocess.run([str(ROOT / "bin" / recipe), "--dry-run", *args], capture_output=True, text=True,
                         timeout=120, env=clean_env(SPECWS_DEST=str(dest), OUT=str(dest / "out")))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout
