"""What a run records carries no secrets: credentials in URIs, secret-named env values and every registered
literal secret (from the config, the overrides, the runner's environment) are redacted from params, tags,
artifacts, the Hydra folder, server logs and the offline store."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from conftest import compose_cfg, run_workspace
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.config.views import typed_run
from experiments.harness.launch import LaunchSpec, build_launch_spec
from experiments.harness.server import Server
from experiments.tracking import redact
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.redact import redact_env, redact_text
from experiments.tracking.redacting import RedactingClient
from experiments.tracking.store import flatten
from tests.helpers.loopback_server import MODULE as LOOPBACK

SECRETS = ("s3cr3t", "hf_abc123", "sk-live")


def test_uri_credentials_and_secret_env_names() -> None:
    assert redact_text("see https://user:s3cr3t@host:5000/x and http://tok@h") == "see https://***@host:5000/x and http://***@h"
    assert redact_text("sqlite:////tmp/mlflow.db user@example.org") == "sqlite:////tmp/mlflow.db user@example.org"
    env = {"HF_TOKEN": "hf_abc123", "OPENAI_API_KEY": "sk-live", "DB_PASSWORD": "p", "PROXY": "http://u:p@proxy",
           "SPECWS_MOE_EXPERT_BUDGET": "8", "OMP_NUM_THREADS": "4"}
    assert redact_env(env) == {"HF_TOKEN": "***", "OPENAI_API_KEY": "***", "DB_PASSWORD": "***",
                               "PROXY": "http://***@proxy", "SPECWS_MOE_EXPERT_BUDGET": "8", "OMP_NUM_THREADS": "4"}


def test_params_tags_and_launch_spec_are_redacted_in_the_store(store: str, tmp_path: Path) -> None:
    cfg = compose_cfg("+option=A", "+engine.env.HF_TOKEN=hf_abc123", "+site.env.OPENAI_API_KEY=sk-live",
                      "+run.tags.source=https://me:s3cr3t@git.example.org/repo", f"tracking.uri={store}")
    client = MlflowClient(store)
    exp_id = client.create_experiment("redact", artifact_location=(tmp_path / "artifacts").as_uri())
    spec = build_launch_spec(typed_run(cfg))
    assert spec.env["HF_TOKEN"] == "hf_abc123"   # the server itself still gets the real value
    tags = {"specws.source": str(cfg.run.tags.source), "specws.pair_key": "abc"}
    with tracked_run(client, exp_id, "r", tags, flatten(cfg)) as run:
        client.log_dict(run.id, spec.to_dict(), "launch_spec.json")
    recorded = client.get_run(run.id)
    params, tags = recorded.data.params, recorded.data.tags
    assert params["engine.env.HF_TOKEN"] == "***" and params["site.env.OPENAI_API_KEY"] == "***"
    assert params["run.tags.source"] == tags["specws.source"] == "https://***@git.example.org/repo"
    assert tags["specws.pair_key"] == "abc" and params["engine.name"] == "vllm"
    launch = json.loads(Path(client.download_artifacts(run.id, "launch_spec.json", str(tmp_path))).read_text())
    assert launch["env"]["HF_TOKEN"] == "***" and launch["env"]["OPENAI_API_KEY"] == "***"
    everything = json.dumps([params, tags, launch])
    assert not [s for s in SECRETS if s in everything]


# --- literal secrets: collectors, files, the redacting client, a whole run -------------------------------------

PLANTED = {"env": "hf_planted_env_1234", "engine": "sk-planted-engine", "uri": "s3cretpw",
           "flag": "planted-flag-456"}


@pytest.fixture(autouse=True)
def no_registered_secrets(monkeypatch) -> None:
    """Each test starts from an empty process-wide set and leaves none behind."""
    monkeypatch.setattr(redact, "_registered", set())


def _leaks(folders: list[Path], secrets) -> list[tuple[str, str]]:
    """(file, secret) for every secret found in any byte of any file under `folders`."""
    out = []
    for folder in folders:
        for path in (p for p in folder.rglob("*") if p.is_file()):
            data = path.read_bytes()
            out += [(str(path), s) for s in secrets if s.encode() in data]
    return out


def test_secret_key_names_are_strict() -> None:
    secret = ["hf_token", "api_key", "API_KEY", "apikey", "--api-key", "--hf-token", "token", "db_passwd",
              "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "credentials", "basic_auth", "client_secret",
              "+engine.env.HF_TOKEN"]
    not_secret = ["max_tokens", "num_draft_tokens", "bos_token_id", "num_key_value_heads", "tokenizer", "key",
                  "SSH_AUTH_SOCK", "--max-num-batched-tokens", "monkey"]
    assert all(map(redact.secret_key, secret)) and not any(map(redact.secret_key, not_secret))


def test_secrets_of_config_env_blocks_uri_passwords_leaves_and_flags() -> None:
    cfg = {"engine": {"env": {"API_KEY": "sk-engine-1", "OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1"},
                      "extra_args": ["--api-key", "flag-value-1", "--hf-token=flag-value-2", "--dtype", "bf16"],
                      "max_tokens": "not-a-secret-1"},
           "site": {"env": {"HF_TOKEN": "hf_site_1", "PROXY": "http://bob:proxypass1@proxy:3128"}},
           "tracking": {"uri": "http://alice:s3cretpw@host/", "password": "pw-leaf-1", "use_auth": True},
           "model": {"bos_token_id": 1, "tokenizer": "tok-path"},
           "run": {"tags": {"api_token": "tag-token-1"}, "note": "serve --token tok-in-string-1 now"},
           "short": {"env": {"DB_PASSWORD": "p"}, "token": "8"}}
    assert redact.secrets_of_config(cfg) == {"sk-engine-1", "flag-value-1", "flag-value-2", "hf_site_1",
                                             "proxypass1", "s3cretpw", "pw-leaf-1", "tag-token-1", "tok-in-string-1"}


def test_secrets_of_environ_and_of_the_overrides() -> None:
    environ = {"HF_TOKEN": "hf_env_1", "MLFLOW_TRACKING_PASSWORD": "mlpw-1", "AWS_SECRET_ACCESS_KEY": "aws-1",
               "GITHUB_TOKEN": "", "SHORT_TOKEN": "ab", "SSH_AUTH_SOCK": "/tmp/ssh/agent.1", "HOME": "/root",
               "HTTPS_PROXY": "http://u:proxy-pw-1@proxy:3128", "MAX_TOKENS": "512"}
    assert redact.secrets_of_environ(environ) == {"hf_env_1", "mlpw-1", "aws-1", "proxy-pw-1"}
    overrides = ["+option=baseline", "+engine.env.API_KEY=sk-over-1", "+run.tags.api_token='tok-over-1'",
                 "tracking.uri=http://alice:uri-pw-1@host/", "+engine.extra_args=[--api-key,flag-over-1]",
                 "workload.max_tokens=4096", "hydra.job.env_set.HF_TOKEN=hf_over_1"]
    assert redact.secrets_of_overrides(overrides) == {"sk-over-1", "tok-over-1", "uri-pw-1", "flag-over-1", "hf_over_1"}


def test_registered_literals_are_masked_in_text_and_files(tmp_path: Path) -> None:
    redact.register_secrets(["planted-literal-1", "abc", "true", "1234", "planted-literal-1-longer"])
    # too short, a boolean, a number: not registered
    assert redact.registered_secrets() == {"planted-literal-1", "planted-literal-1-longer"}
    assert redact_text("a planted-literal-1-longer b planted-literal-1 true 1234") == "a *** b *** true 1234"
    text = tmp_path / "log.txt"
    text.write_text("$ serve --api-key planted-literal-1\r\nok\n")
    text.chmod(0o640)
    binary = tmp_path / "sub" / "weights.bin"
    binary.parent.mkdir()
    binary.write_bytes(b"\0planted-literal-1")
    latin = tmp_path / "sub" / "latin.txt"
    latin.write_bytes("planted-literal-1 caf\xe9".encode("latin-1"))
    clean = tmp_path / "clean.txt"
    clean.write_text("nothing here")
    config = tmp_path / "config.yaml"
    config.write_text("env:\n  API_KEY: planted-literal-1\nargs:\n- planted-literal-1 x\n")
    assert redact.redact_folder(tmp_path) == 2
    assert text.read_bytes() == b"$ serve --api-key ***\r\nok\n" and text.stat().st_mode & 0o777 == 0o640
    assert yaml.safe_load(config.read_text()) == {"env": {"API_KEY": "***"}, "args": ["*** x"]}   # still YAML
    assert binary.read_bytes() == b"\0planted-literal-1" and latin.read_bytes().startswith(b"planted-literal-1")
    assert not redact.redact_file(clean) and sorted(p.name for p in tmp_path.rglob("*")) == [
        "clean.txt", "config.yaml", "latin.txt", "log.txt", "sub", "weights.bin"]   # no temporary file left


def _write_files(folder: Path, secret: str) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"engine:\n  env:\n    API_KEY: {secret}\n")
    (folder / "plot.png").write_bytes(b"\x89PNG\0" + secret.encode())
    return folder / "config.yaml", folder / "plot.png"


def _exercise(client, exp_id: str, tmp_path: Path, secret: str) -> str:
    """Every write the wrapper redacts, each carrying `secret`."""
    run_id = client.create_run(exp_id, run_name=f"run-{secret}", tags={"note": secret}).info.run_id
    client.set_tag(run_id, "source", f"https://me:{secret}@git.example.org/x")
    client.log_param(run_id, "engine.env.HF_TOKEN", "hf_short")
    client.log_param(run_id, "run.tags.note", secret)
    client.log_batch(run_id, metrics=[Metric("m", 1.5, 0, 0)], params=[Param("p", f"x {secret}")],
                     tags=[RunTag("t", secret)])
    client.log_dict(run_id, {"argv": ["--api-key", secret], secret: {"nested": [secret]}}, "spec.json")
    client.log_text(run_id, f"line {secret}\n", "notes.txt")
    config, png = _write_files(tmp_path / "src" / ".hydra", secret)
    client.log_artifact(run_id, str(config), "single")
    client.log_artifact(run_id, str(png), "single")
    client.log_artifacts(run_id, str(config.parent), ".hydra")
    assert secret in config.read_text()   # the originals stay as they are
    return run_id


def _check_recorded(client, run_id: str, secret: str, artifacts: Path) -> None:
    run = client.get_run(run_id)
    assert run.info.run_name == "run-***" and run.data.tags["note"] == run.data.tags["t"] == "***"
    assert run.data.tags["source"] == "https://***@git.example.org/x"
    assert run.data.params == {"engine.env.HF_TOKEN": "***", "run.tags.note": "***", "p": "x ***"}
    assert run.data.metrics == {"m": 1.5}
    spec = json.loads(Path(client.download_artifacts(run_id, "spec.json", str(artifacts.parent / "dl"))).read_text())
    assert spec == {"argv": ["--api-key", "***"], "***": {"nested": ["***"]}}
    hydra = sorted(p.relative_to(artifacts) for p in artifacts.rglob("*.yaml"))
    assert [p.parts[-2:] for p in hydra] == [(".hydra", "config.yaml"), ("single", "config.yaml")]
    assert all("API_KEY: '***'" in (artifacts / p).read_text() for p in hydra)
    pngs = list(artifacts.rglob("plot.png"))
    assert len(pngs) == 2 and all(p.read_bytes().endswith(secret.encode()) for p in pngs)   # binary: as is


def test_redacting_client_over_a_real_mlflow_store(store: str, tmp_path: Path) -> None:
    secret = "planted-client-mlflow"
    redact.register_secrets([secret])
    client = RedactingClient(MlflowClient(store))
    exp_id = client.create_experiment("redact", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = _exercise(client, exp_id, tmp_path, secret)
    # MlflowClient's own argument order: create_run(experiment_id, start_time, tags, run_name)
    positional = client.create_run(exp_id, None, {"note": secret}, f"pos-{secret}").info.run_id
    dataset = Dataset(name=f"set-{secret}", digest="d1", source_type="local",
                      source=json.dumps({"uri": f"https://bob:{secret}@data.example.org/p.jsonl"}))
    assert hasattr(client, "log_inputs") and client.tracking_uri == store
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "measured")])])
    _check_recorded(client, run_id, secret, tmp_path / "artifacts")
    logged = client.get_run(run_id).inputs.dataset_inputs[0].dataset
    assert logged.name == "set-***" and "https://***@data.example.org" in logged.source
    assert client.get_run(positional).data.tags["note"] == "***"
    assert {r.info.run_id for r in client.search_runs([exp_id])} == {run_id, positional}
    assert _leaks([tmp_path / "artifacts"], [secret]) == [(str(p), secret) for p in
                                                          sorted((tmp_path / "artifacts").rglob("plot.png"))]
    assert secret.encode() not in (tmp_path / "mlflow.db").read_bytes()


def test_redacting_client_over_the_offline_store(tmp_path: Path) -> None:
    secret = "planted-client-offline"
    redact.register_secrets([secret])
    client = RedactingClient(OfflineClient(tmp_path / "offline"))
    assert not hasattr(client, "log_inputs")   # the store's own switch (log_prompt_dataset) keeps working
    run_id = _exercise(client, "exp", tmp_path, secret)
    positional = client.create_run("exp", f"pos-{secret}", {"note": secret}).info.run_id
    _check_recorded(client, run_id, secret, tmp_path / "offline" / run_id / "artifacts")
    assert client.get_run(positional).info.run_name == "pos-***" and client.root == tmp_path / "offline"
    leaks = _leaks([tmp_path / "offline"], [secret])
    assert leaks and all(path.endswith("plot.png") for path, _ in leaks)


def test_server_log_header_and_body_are_redacted(tmp_path: Path) -> None:
    secret = "planted-served-name"
    redact.register_secrets([secret])
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    spec = LaunchSpec(engine="loopback", python=sys.executable, module=LOOPBACK, health_path="/health", env=env,
                      args=["--ttft-ms", "1", "--itl-ms", "1", "--served-model-name", secret])
    server = Server(spec, tmp_path / "server-x.log")
    server.start(30, health_poll_s=0.1)
    try:
        assert secret not in server.log_path.read_text().splitlines()[0]
        with open(server.log_path, "a") as log:   # as an engine echoing its arguments would
            log.write(f"serving {secret}\n")
    finally:
        server.stop()
    text = server.log_path.read_text()
    assert text.startswith(f"$ {sys.executable} -m {LOOPBACK} ") and "--served-model-name ***" in text
    assert "serving ***" in text and secret not in text


@pytest.mark.parametrize("kind", ["sqlite", "offline-sweep"])
def test_a_dry_run_records_none_of_the_planted_secrets(tmp_path: Path, embedded_ready, kind: str) -> None:
    """One run into SQLite, or a sweep of one job (its parent run, multirun.yaml) into the offline store."""
    stored, hydra = tmp_path / "store", tmp_path / "hydra"
    sweep = kind == "offline-sweep"
    uri = f"offline://{stored}" if sweep else f"sqlite:///{stored / 'mlflow.db'}"
    overrides = [*(["-m", f"hydra.sweep.dir={hydra}"] if sweep else [f"hydra.run.dir={hydra}"]),
                 "+option=baseline", "run.dry_run=true", f"tracking.uri={uri}",
                 f"tracking.artifact_root={stored / 'artifacts'}",
                 f"+engine.env.API_KEY={PLANTED['engine']}", f"+engine.extra_args=[--hf-token,{PLANTED['flag']}]",
                 f"+site.env.PROXY_URL=http://alice:{PLANTED['uri']}@proxy.invalid:3128",
                 "+run.tags.note=${oc.env:HF_TOKEN}"]   # the environment's token lands in tags and a param
    control = tmp_path / "control.txt"   # the scan finds each secret where it is
    control.write_text(" ".join(overrides) + PLANTED["env"])
    assert len(_leaks([tmp_path], PLANTED.values())) == 4
    control.unlink()
    out = run_workspace(*overrides, env={"HF_TOKEN": PLANTED["env"]}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _leaks([stored, hydra], PLANTED.values()) == []
    assert "+engine.env.API_KEY=***" in next(hydra.rglob("overrides.yaml")).read_text()
    uploaded = [p for p in stored.rglob("*.yaml") if p.parent.name == ".hydra"]
    assert len(uploaded) == 3 and "API_KEY: '***'" in next(p for p in uploaded if p.name == "config.yaml").read_text()
    assert all(yaml.safe_load(p.read_text()) for p in [*uploaded, *hydra.rglob("*.yaml")])
    launch = json.loads(next(stored.rglob("launch_spec.json")).read_text())
    assert launch["argv"][launch["argv"].index("--hf-token") + 1] == "***"   # an --api-key is refused: its own test
    assert launch["env"]["PROXY_URL"] == "http://***@proxy.invalid:3128"
    client = OfflineClient(stored) if sweep else MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("smollm2_135m@local").experiment_id])
    (run,) = [r for r in runs if "note" in r.data.tags]
    assert run.data.tags["note"] == run.data.params["run.tags.note"] == "***"
    if sweep:   # the parent's record of the overrides holds the resolved token
        (parent,) = [r for r in runs if r.data.tags.get("specws.sweep") == "parent"]
        assert "+run.tags.note=***" in parent.data.tags["specws.sweep_overrides"]
        assert (hydra / "multirun.yaml").exists()
