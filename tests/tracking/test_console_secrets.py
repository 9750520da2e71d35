"""No secret on the console: a passing and a failing `python -m experiments.run` against the team's tracking server
(PostgreSQL + mlflow server, tests/helpers/tracking_server.py) whose URI carries a password, with a secret in
engine.env and one in an override; stdout, stderr and every byte written (the run's output folders, the tracking
server's database, artifacts and logs) are searched for each. Also in-process: the redacting stream and log
records (experiments.tracking.console_guard)."""
from __future__ import annotations

import io
import logging

import pytest
from conftest import run_workspace
from mlflow.tracking import MlflowClient

from experiments.tracking.console_guard import RedactingStream, redact_logs
from experiments.tracking.redact import register_secrets
from tests.helpers.tracking_server import FAST_GIVE_UP, running_tracking_server

EXPERIMENT = "smollm2_135m@local"
SECRETS = {"uri": "pw-in-the-uri-4417", "engine": "sk-engine-env-8812", "override": "tok-override-3390"}
EAGER = 'site.engine_args.vllm=[--dtype,bfloat16,--max-model-len,"2048",--enforce-eager]'


@pytest.mark.slow
def test_no_secret_on_the_console_or_in_any_byte_of_a_passing_and_a_failing_run(embedded_ready, tmp_path) -> None:
    with running_tracking_server() as server:
        uri = server.uri.replace("http://", f"http://alice:{SECRETS['uri']}@")
        args = ["+option=baseline", "workload=smoke", "tracking=server", f"tracking.uri={uri}", EAGER,
                f"+engine.env.API_KEY={SECRETS['engine']}", f"+run.tags.api_token={SECRETS['override']}"]
        env = {**FAST_GIVE_UP, "HF_HUB_OFFLINE": "1", "COLUMNS": "1000"}
        passing = run_workspace(*args, "run.dry_run=true", f"hydra.run.dir={tmp_path / 'pass'}", env=env,
                                timeout=600)
        # the engine is started and given 1 s to become healthy: the run fails after it was created
        failing = run_workspace(*args, "server.startup_timeout_s=1", f"hydra.run.dir={tmp_path / 'fail'}", env=env,
                                timeout=600)
        client = MlflowClient(server.uri)
        runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
        written = [p for folder in (tmp_path, server.folder) for p in folder.rglob("*") if p.is_file()]
        leaks = [(str(p), name) for p in written for name, secret in SECRETS.items()
                 if secret.encode() in p.read_bytes()]
    assert passing.returncode == 0, passing.stderr[-3000:]
    assert failing.returncode == 1, failing.stderr[-3000:]
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    said = {"passing": passing.stdout + passing.stderr, "failing": failing.stdout + failing.stderr}
    assert "Error executing job with overrides" in said["failing"] and "+engine.env.API_KEY=***" in said["failing"]
    assert "EngineStartError" in said["failing"] and "View run" not in said["passing"] + said["failing"]
    assert [(run, name) for run, text in said.items() for name, secret in SECRETS.items() if secret in text] == []
    assert leaks == []
    assert len(written) > 100 and any(p.name.startswith("launch_spec") for p in written)   # the search saw them
    assert all(secret in " ".join(args) + uri for secret in SECRETS.values())


def test_a_redacting_stream_masks_a_secret_split_over_writes_and_log_records_are_redacted() -> None:
    secret = "sk-split-secret-2291"
    register_secrets([secret])
    out = io.StringIO()
    stream = RedactingStream(out)
    stream.write("key sk-split-")
    stream.write("secret-2291 at http://bob:pw1234@host:1/x\npartial ")
    assert out.getvalue() == "key *** at http://***@host:1/x\n"
    stream.write(secret)
    stream.flush()
    assert out.getvalue().endswith("partial ***") and secret not in out.getvalue()

    redact_logs()
    logged = io.StringIO()
    log = logging.getLogger("specws.test.console")
    handler = logging.StreamHandler(logged)
    log.addHandler(handler)
    try:
        log.warning("opened %s", f"sqlite:///{secret}.db")
        try:
            raise ValueError(f"bad {secret}")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    assert secret not in logged.getvalue() and "opened sqlite:///***.db" in logged.getvalue()
    assert "ValueError: bad ***" in logged.getvalue()
