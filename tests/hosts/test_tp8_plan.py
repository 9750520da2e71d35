"""bin/tp8-plan: valid bash, every module it starts exists and parses its arguments, and the site it names composes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import compose_cfg

from experiments.config.paths import ROOT

PLAN = ROOT / "bin" / "tp8-plan"


def modules() -> list[str]:
    return sorted(set(re.findall(r"python3 -m ([\w.]+)", PLAN.read_text())))


def test_plan_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(PLAN)]).returncode == 0


@pytest.mark.parametrize("module", [m for m in modules() if m != "experiments.run"])
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_plan_measures_the_options_on_the_tp8_site() -> None:
    text = PLAN.read_text()
    for option in ("baseline", "A", "B", "E"):
        assert f"+option={option}" in text
    assert "NCCL_NVLS_ENABLE=0" in text and "--tp 8" in text
    cfg = compose_cfg("site=h200x8-kimi", "+option=E", "model.hf_config.num_hidden_layers=61")
    assert cfg.model.arch.num_hidden_layers == 61 and cfg.site.gpus == 8
