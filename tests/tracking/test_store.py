"""Two multirun sweeps writing to one SQLite store at the same time both complete."""
from __future__ import annotations

import os
import subprocess
import sys

from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT


def test_parallel_multiruns_share_one_store(store: str, tmp_path, embedded_ready) -> None:
    procs = []
    for i, lengths in enumerate(["2,3", "4,5"]):
        argv = [sys.executable, "-m", "experiments.run", "-m", "+option=A", "run.dry_run=true",
                f"spec.num_draft_tokens={lengths}", f"tracking.uri={store}",
                f"tracking.artifact_root={tmp_path / 'artifacts'}", f"hydra.sweep.dir={tmp_path / f'sweep{i}'}"]
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}))
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("smollm2_135m@local")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and len(children) == 4, [(r.info.run_name, r.data.tags) for r in runs]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {p.info.run_id for p in parents}
    assert sorted(c.data.params["spec.num_draft_tokens"] for c in children) == ["2", "3", "4", "5"]
    for child in children:
        assert "launch_spec.json" in [a.path for a in client.list_artifacts(child.info.run_id)]
