"""What a run records carries no secrets: credentials in URIs and secret-named env values are redacted from
params, tags and launch_spec.json in a real MLflow store."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import compose_cfg
from mlflow.tracking import MlflowClient

from experiments.harness.launch import build_launch_spec
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.redact import redact_env, redact_text
from experiments.tracking.store import flatten

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
    spec = build_launch_spec(cfg)
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
