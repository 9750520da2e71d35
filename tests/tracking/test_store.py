"""Two multirun sweeps writing to one SQLite store at the same time both complete; a run that was gone is failed at the
next start; a mapping keyed by token strings is one param; the prompts' dataset digest is that of the prompts measured
(quick and grounded, one prompt set, two datasets)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import compose_cfg
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.config.views import tracking_view
from experiments.tracking.store import flatten, log_params, log_prompt_dataset, measured_digest


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


def test_a_run_left_running_by_a_gone_runner_fails_at_the_next_start(tmp_path) -> None:
    """A runner killed with SIGKILL leaves its run RUNNING; the next contact with the store marks it FAILED,
    and leaves a run whose runner is alive alone."""
    import subprocess
    import sys

    from conftest import compose_cfg

    from experiments.tracking import runs
    from experiments.tracking.lifecycle import RUNNER_TAG, tracked_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose_cfg("+option=A", f"tracking.uri={uri}")
    client, exp_id = runs.setup(tracking_view(cfg))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ids, open_runs = {}, []
    for who in ("gone", "alive"):
        open_runs.append(tracked_run(client, exp_id, who, {}))
        ids[who] = open_runs[-1].__enter__().id   # left open: its runner never closes it
    client.set_tag(ids["gone"], RUNNER_TAG, f"{gone.pid}:1.0")
    runs._checked_for_stale.clear()
    runs.setup(tracking_view(cfg))
    assert client.get_run(ids["gone"]).info.status == "FAILED"
    assert "ended without closing it" in client.get_run(ids["gone"]).data.tags["specws.failure"]
    assert client.get_run(ids["alive"]).info.status == "RUNNING"


def test_a_mapping_keyed_by_token_strings_is_logged_whole_to_a_real_store(store: str) -> None:
    """The Kimi miniature's tokenizer.special_ids ('[BOS]': 163584, ...) are data, not param names."""
    cfg = compose_cfg("model=kimi_k25_mini", "site=h200-kimi")
    params = flatten(cfg)
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("special-ids"))
    log_params(client, run.info.run_id, params)
    logged = client.get_run(run.info.run_id).data.params
    assert json.loads(logged["model.tokenizer.special_ids"])["[BOS]"] == 163584
    assert logged["model.tokenizer.bos"] == "[BOS]" and logged["site.name"] == str(cfg.site.name)


def _logged_dataset(client: MlflowClient, exp: str, workload: str, tmp: Path) -> tuple[str, str, int, dict]:
    """The workload prepared as a run prepares it, its prompts logged as the run's dataset input with the ids it
    measures; returns the whole prompt set's digest, the dataset's digest, the prompts measured and prompt_set.json."""
    from experiments.config.views import views_of
    from experiments.harness.prepare import prepare_workload

    cfg = compose_cfg("+option=A", f"workload={workload}", "model.path=/nonexistent")
    prepared = prepare_workload(views_of(cfg))
    rows = [{"id": c.id, "category": c.category, "text": "\n---\n".join(c.user_turns)} for c in prepared.conversations]
    run_id = client.create_run(exp, run_name=workload).info.run_id
    log_prompt_dataset(client, run_id, workload, str(cfg.workload.prompt_set), rows, prepared.digest,
                       prepared.measured_ids())
    (dataset,) = client.get_run(run_id).inputs.dataset_inputs
    record = json.loads(Path(client.download_artifacts(run_id, "prompt_set.json", str(tmp))).read_text())
    return prepared.digest, dataset.dataset.digest, len(prepared.measured_ids()), record


def test_the_dataset_digest_follows_the_prompts_measured(store: str, tmp_path: Path) -> None:
    """quick and grounded send from the same prompt set (one digest for the whole set), but measure 24 and 63 of its
    prompts: their datasets differ, each the digest of its measured prompts; logging the same again gives the same."""
    client = MlflowClient(store)
    exp = client.create_experiment("datasets", artifact_location=str(tmp_path / "artifacts"))
    quick_set, quick, n_quick, record = _logged_dataset(client, exp, "quick", tmp_path)
    grounded_set, grounded, n_grounded, _ = _logged_dataset(client, exp, "grounded", tmp_path)
    assert quick_set == grounded_set and quick != grounded and (n_quick, n_grounded) == (24, 63)
    assert record["digest"][:36] == quick and record["prompt_set_digest"] == quick_set
    assert len(record["measured"]) == 24 and len(record["rows"]) > 24
    assert measured_digest(record["rows"], set(record["measured"]))[:36] == quick
    assert _logged_dataset(client, exp, "quick", tmp_path)[1] == quick


def test_a_run_opened_outside_the_runner_masks_the_configs_secrets(tmp_path, monkeypatch) -> None:
    """Entry points other than `experiments.run` (option E's offline budget, the MoE telemetry) open their runs
    directly: the config's secrets are masked in what such a run writes, not only when run.py registered them."""
    from experiments.config.views import typed_run
    from experiments.tracking import redact
    from experiments.tracking.runs import open_run

    monkeypatch.setattr(redact, "_registered", set())
    planted = "hf_planted_secret_value_42"
    cfg = compose_cfg("+option=A", f"+engine.env.HF_TOKEN={planted}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
                      f"tracking.artifact_root={tmp_path / 'artifacts'}")
    with open_run(typed_run(cfg), "measure", "outside") as run:
        run.client.set_tag(run.id, "specws.note", f"token {planted}")
    tags = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").get_run(run.id).data.tags
    assert planted in redact.registered_secrets() and planted not in tags["specws.note"]
