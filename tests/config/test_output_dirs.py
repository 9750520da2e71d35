"""Two runners started in the same second get their own Hydra output folders (the runner's pid is in them)."""
from __future__ import annotations

import json
import subprocess
import sys

from experiments.config.paths import ROOT

COMPOSE = """
import json, os
from experiments.config import paths
from hydra import compose, initialize_config_dir
with initialize_config_dir(config_dir=str(paths.ROOT / "conf"), version_base="1.3"):
    cfg = compose(config_name="config", overrides=["+option=A"], return_hydra_config=True)
print(json.dumps([os.getpid(), cfg.hydra.run.dir, cfg.hydra.sweep.dir]))
"""


def test_two_runners_in_one_second_get_distinct_output_folders() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", COMPOSE], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    (pid_a, run_a, sweep_a), (pid_b, run_b, sweep_b) = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert run_a != run_b and sweep_a != sweep_b
    assert run_a.endswith(f"-{pid_a}") and sweep_b.endswith(f"-{pid_b}")
    assert run_a.startswith("outputs/") and sweep_a.startswith("multirun/")
