"""jit_prebuild: unknown modules are refused before anything is installed, and the shim makes SGLang 0.5.14's
JIT loader importable beside this machine's CPU torch, where importing the whole overlay package fails; the
cache folder it names for sm_90 is the one the H200 host's SGLang looks in."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config.paths import ROOT
from experiments.hosts import jit_prebuild

NAME_FOR_SM90 = """
from sglang.jit_kernel import utils
with utils.override_jit_cuda_arch(9, 0, ""):
    print(utils._jit_build_dir_name("sgl_kernel_jit_x"))
"""


def test_an_unknown_module_is_refused_before_the_toolkit_is_installed(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "experiments.hosts.jit_prebuild", "--modules", "moe_wna16_marlin,nope",
                          "--work", str(tmp_path / "work")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "unknown modules ['nope']" in out.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.skipif(not (jit_prebuild.SGLANG / "sglang-0.5.14.dist-info").is_dir(),
                    reason="the SGLang 0.5.14 overlay (bin/setup) is not installed")
def test_the_shim_imports_the_jit_loader_and_names_the_sm90_cache_folder(tmp_path: Path) -> None:
    shim = jit_prebuild.sglang_shim(tmp_path / "shim")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(jit_prebuild.SGLANG)])}
    out = subprocess.run([sys.executable, "-c", NAME_FOR_SM90], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("sgl_kernel_jit_x__arch_9.0__tvmffi_")
