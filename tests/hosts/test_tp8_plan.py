"""The tp8 plan (experiments/plans/tp8.py, bin/tp8-plan): every module it starts exists and parses its arguments,
the site it names composes, every runner step composes there as the plan passes it (the common overrides, then the
step's own), NVLink multicast is off in every step's environment, and fewer than 8 GPUs run the all-reduce only."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.plans.host import Host
from experiments.plans.plan import runner_for
from experiments.plans.tp8 import PLAN, Settings
from tests.helpers.plans import module_answers_help, planned_steps, recipe_dry_run, started_modules


def with_traces(dest: Path) -> Path:
    """dest with rank 0's decode traces, as the trace step leaves them (the profile steps follow them)."""
    for c in (1, 128):
        folder = dest / "out" / "tp8" / "trace" / f"c{c}"
        folder.mkdir(parents=True)
        (folder / f"host_TP-0_{c}.trace.json.gz").write_bytes(b"")
    return dest


def modules() -> list[str]:
    dest = with_traces(Path(tempfile.mkdtemp()))
    return sorted(started_modules(planned_steps("tp8", dest)) - {"experiments.run"})


@pytest.mark.parametrize("module", modules())
def test_every_module_the_plan_starts_answers_help(module: str) -> None:
    module_answers_help(module)


def test_the_plan_measures_the_options_on_the_tp8_site(tmp_path: Path) -> None:
    steps = planned_steps("tp8", with_traces(tmp_path))
    assert list(steps) == ["allreduce", "allreduce-nvlink", "build", "trace", "profile-c1", "profile-c128",
                           "baseline", "E", "tp-workers", "B", "A"]
    assert "--tp 8" in steps["tp-workers"][-1] and f"{tmp_path}/hydra/E/server-" in steps["tp-workers"][-1]
    cfg = compose_cfg("site=h200x8-kimi", "+option=E", "model.hf_config.num_hidden_layers=61")
    assert cfg.model.arch.num_hidden_layers == 61 and cfg.site.gpus == 8


def test_every_step_runs_with_nvlink_multicast_off(tmp_path: Path) -> None:
    env = runner_for(PLAN, Settings(), Host(tmp_path, tmp_path / "out"), dry_run=True).env
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["PYTHONPATH"] == f"{tmp_path}/site"


def test_every_runner_step_composes_on_the_tp8_site_with_its_own_overrides_last(tmp_path: Path) -> None:
    steps = planned_steps("tp8", tmp_path, "overrides=workload.max_tokens=32")
    runs = {name: argv[3:] for name, argv in steps.items() if argv[:3] == ["python3", "-m", "experiments.run"]}
    assert set(runs) == {"baseline", "E", "B", "A"}
    for name, overrides in runs.items():
        assert overrides[0] == "site=h200x8-kimi" and overrides[-2] == f"+option={name}", overrides
        cfg = compose_cfg(*[o for o in overrides if not o.startswith("hydra.")])
        assert cfg.model.arch.num_hidden_layers == 61 and cfg.workload.num_prompts == 320
        assert cfg.workload.max_tokens == 32 and list(cfg.workload.concurrency) == [1, 4, 16, 64, 128]


def test_fewer_than_eight_gpus_run_only_the_all_reduce_benchmark(tmp_path: Path) -> None:
    steps = planned_steps("tp8", tmp_path, "gpus=4")
    assert set(steps) == {"allreduce", "allreduce-nvlink"} and steps["allreduce"][:2] == ["env", "NCCL_P2P_DISABLE=1"]
    assert steps["allreduce-nvlink"][-4:-2] == ["--gpus", "4"]
    out = recipe_dry_run("tp8-plan", tmp_path, "gpus=4")
    assert "== gpus=4: the TP-8 steps need 8 GPUs" in out and "dry-run build" not in out, out
