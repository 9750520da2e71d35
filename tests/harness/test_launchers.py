"""The sweep launchers (conf/hydra/launcher/): composed by Hydra into the parameters submitit's executors get, and a
Slurm submission made for real by `python -m experiments.run -m hydra/launcher=slurm_box` up to `sbatch`, which
refuses it here (no Slurm on this machine): the job script it was handed is the one a cluster would run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT

REFUSING_SBATCH = """#!/bin/sh
cp "$1" "$SBATCH_CAPTURE"
echo "sbatch: error: Batch job submission failed: refused by the test" >&2
exit 1
"""


def launcher_params(*overrides: str) -> tuple[str, dict]:
    """The launcher Hydra instantiates for a sweep with `overrides`, and the parameters it hands submitit."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", ["+option=A", *overrides], return_hydra_config=True)
        launcher = instantiate(cfg.hydra.launcher)
    return type(launcher).__name__, launcher.params


def test_local_launcher_gives_each_job_the_sites_gpus() -> None:
    name, params = launcher_params("hydra/launcher=local", "site=h200")
    assert name == "LocalLauncher" and params["gpus_per_node"] == 1 and params["timeout_min"] == 240
    # plain submitit_local hides every GPU from its jobs (CUDA_VISIBLE_DEVICES=""); local gives the site's
    assert launcher_params("hydra/launcher=local")[1]["gpus_per_node"] == 0


def test_slurm_box_takes_the_whole_box_and_its_partition_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SPECWS_SLURM_PARTITION", "box-gpu")
    monkeypatch.setenv("SPECWS_SLURM_ACCOUNT", "spec-team")
    name, params = launcher_params("hydra/launcher=slurm_box", "site=blackwell")
    assert name == "SlurmLauncher"
    assert (params["partition"], params["account"], params["gpus_per_node"]) == ("box-gpu", "spec-team", 8)
    assert (params["array_parallelism"], params["timeout_min"], params["nodes"]) == (1, 240, 1)


def test_slurm_cluster_follows_the_site_and_takes_overrides(monkeypatch) -> None:
    monkeypatch.delenv("SPECWS_SLURM_PARTITION", raising=False)
    _, params = launcher_params("hydra/launcher=slurm_cluster", "site=h200", "hydra.launcher.partition=h200q",
                                "hydra.launcher.timeout_min=45", "+hydra.launcher.constraint=h200")
    assert (params["partition"], params["gpus_per_node"], params["timeout_min"]) == ("h200q", 1, 45)
    assert params["constraint"] == "h200" and params["qos"] is None


def test_slurm_sweep_submits_one_array_job_with_the_configured_resources(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in (("sbatch", REFUSING_SBATCH), ("srun", "#!/bin/sh\nexit 1\n")):   # srun: only looked up
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    capture, store, sweep = tmp_path / "job.sh", f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "sweep"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SBATCH_CAPTURE": str(capture),
           "SPECWS_SLURM_PARTITION": "box-gpu"}
    out = subprocess.run([sys.executable, "-m", "experiments.run", "-m", "hydra/launcher=slurm_box", "site=blackwell",
                          "+option=A", "spec.num_draft_tokens=2,4", "run.dry_run=true", f"tracking.uri={store}",
                          f"tracking.artifact_root={tmp_path / 'artifacts'}", f"hydra.sweep.dir={sweep}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "refused by the test" in out.stderr, out.stderr[-3000:]
    script = capture.read_text()
    for line in ("#SBATCH --partition=box-gpu", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --time=240", "#SBATCH --array=0-1%1", "#SBATCH --signal=USR2@120", "#SBATCH --nodes=1"):
        assert line in script.splitlines(), f"{line!r} not in:\n{script}"
    assert f"{sys.executable} -u -m submitit.core._submit" in script
    assert len(list((sweep / ".submitit").rglob("*.pkl"))) == 2   # both jobs pickled: launcher and callback travel
    # the parent run was created before the submission, and recorded in the sweep folder for the jobs
    client = MlflowClient(store)
    (parent,) = client.search_runs([client.get_experiment_by_name("kimi_k25_int4@blackwell").experiment_id])
    assert (sweep / "parent_run_id").read_text().strip() == parent.info.run_id
    assert parent.info.status in {"FAILED", "KILLED"}   # the sweep never ran: not left RUNNING


@pytest.mark.parametrize("launcher", ["local", "slurm_box", "slurm_cluster"])
def test_every_launcher_config_composes(launcher: str) -> None:
    assert launcher_params(f"hydra/launcher={launcher}")[1]["submitit_folder"].endswith(".submitit/%j")
