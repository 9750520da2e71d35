"""The load plan (experiments/plans/load.py: one answer per load on the H200) as `bin/h200 load` starts it: every
module it starts answers --help, a step's own overrides win over the plan's, and the whole plan dry-runs from a
carried work tree (run.dry_run=true for every runner step, SGLang 0.5.14's parser): the closed-loop sweep, the
Poisson rate sweep and their pairing identities reach the offline store, so that a lease is not spent on a run
refused at its start."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.config.paths import cache_dir
from tests.helpers.plans import dry_runs, host_stage, module_answers_help, planned_steps, started_modules

SMOLLM2 = cache_dir() / "models" / "SmolLM2-135M-Instruct"
# the recommendation's choice is read between steps, not as a step
CHOOSER = "experiments.analysis.recommend.remeasure"


@pytest.mark.parametrize("module", sorted(started_modules(planned_steps("load", Path("/tmp/specws"),
                                                                        "gpu_tests=tests/x.py"))
                                          - {"experiments.run"} | {CHOOSER}))
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    module_answers_help(module)


def test_the_open_loop_steps_override_the_closed_loop_levels(tmp_path: Path) -> None:
    steps = planned_steps("load", tmp_path)
    assert list(steps) == ["baseline", "B", "A", "recommend-closed", "poisson-baseline", "poisson-A",
                           "recommend-all"]
    overrides = [o for o in steps["poisson-A"][3:] if o != "-m" and not o.startswith("hydra.")]
    cfg = compose_cfg(*[o.replace("=8,32", "=32") for o in overrides], "site=h200")
    assert cfg.workload.arrival == "poisson" and cfg.workload.rate == 32 and cfg.workload.concurrency == 64
    assert cfg.workload.num_prompts == 128 and cfg.spec.num_draft_tokens == 8
    closed = compose_cfg(*[o.replace("=2,4,8", "=2") for o in steps["B"][3:] if o != "-m"
                           and not o.startswith("hydra.")], "site=h200")
    assert list(closed.workload.concurrency) == [1, 4, 16, 64] and closed.workload.arrival == "closed"


def test_the_knobs_narrow_the_sweeps(tmp_path: Path) -> None:
    steps = planned_steps("load", tmp_path, "rates=4", "b_steps=2", "a_k=4", "open_k=2", "gpu_tests=a.py b.py")
    assert list(steps)[0] == "gpu-tests" and steps["gpu-tests"][-2:] == ["a.py", "b.py"]
    assert "spec.num_steps=2" in steps["B"] and "spec.num_draft_tokens=4" in steps["A"]
    assert "spec.num_draft_tokens=2" in steps["poisson-A"] and "workload.rate=4" in steps["poisson-baseline"]


def test_h200_load_stage_dry_runs_every_step(tmp_path: Path, embedded_ready) -> None:
    gpu_tests = " ".join(f"tests/sglang_patches/{name}.py" for name in
                         ("test_synthetic_router", "test_moe_budget_graphs", "test_patches"))
    tree, dest, env = host_stage(tmp_path, SMOLLM2)
    started = subprocess.run(["bin/h200", "load", f"gpu_tests={gpu_tests}", "--", "run.dry_run=true"], cwd=tree,
                             env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0 and "load: started" in started.stdout, started.stdout + started.stderr
    waited = subprocess.run(["bin/h200", "wait", "1200"], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=1260)
    log = (dest / "plan.log").read_text()
    assert "plan: done" in waited.stdout, log[-4000:]
    for step in ("baseline", "A", "B", "poisson-baseline", "poisson-A"):
        assert re.search(rf"== \S+ {re.escape(step)} rc=0 ", log), (step, log[-4000:])
    assert re.search(r"== \S+ gpu-tests rc=0 ", log), log[-4000:]
    assert "3 skipped" in (dest / "out" / "load" / "gpu-tests.log").read_text()   # no GPU here
    runs = dry_runs(dest / "runs")
    seen = {(r.data.tags["specws.option"], r.data.params.get("workload.arrival"), r.data.params.get("workload.rate"),
             r.data.params.get("spec.num_draft_tokens") if r.data.tags["specws.option"] == "A"
             else r.data.params.get("spec.num_steps")) for r in runs}
    assert {("A", "closed", "None", k) for k in ("2", "4", "8")} <= seen, seen
    assert {("B", "closed", "None", k) for k in ("2", "4", "8")} <= seen, seen
    assert {("A", "poisson", r, "8") for r in ("8", "32")} <= seen, seen
    for run in runs:
        assert run.data.tags["specws.site"] == "h200" and run.data.tags["specws.engine_version"] == "0.5.14"
