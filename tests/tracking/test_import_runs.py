"""`import_runs` checks an offline store given as a folder exactly as one given as a .tar.gz or .tar.xz: the same store
found (nested or not), the same refusals (links out of it, special files, a run.json that is no run, two stores); a
lease's store found by its stem, and a journal store imported as its README says; into a SQLite store elsewhere, the
artifacts go beside that store (not under the current directory), and the prompts' dataset keeps the digest of the
prompts measured."""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest
from conftest import import_into
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.tracking.import_runs import SourceRefused, main, offline_folder, store_archive
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.store import log_prompt_dataset, measured_digest


def offline_store(root: Path) -> str:
    """One finished run with a metric and an artifact, recorded by the offline client."""
    client = OfflineClient(root)
    run_id = client.create_run("exp", "one", {"specws.option": "baseline"}).info.run_id
    client.log_metric(run_id, "output_tok_s", 12.5)
    client.log_dict(run_id, {"ok": True}, "summary.json")
    client.set_terminated(run_id, "FINISHED")
    return run_id


def as_given(folder: Path, form: str) -> Path:
    """The folder itself, or a .tar.gz / .tar.xz of it (links kept as links, as `tar czf` would)."""
    if form == "folder":
        return folder
    archive = folder.parent / f"{folder.name}.{form}"
    with tarfile.open(archive, f"w:{form.removeprefix('tar.')}") as tar:
        tar.add(folder, arcname=folder.name)
    return archive


FORMS = ["folder", "tar.gz", "tar.xz"]


@pytest.mark.parametrize("form", FORMS)
def test_a_store_nested_in_the_source_is_found_either_way(tmp_path: Path, form: str) -> None:
    run_id = offline_store(tmp_path / "src" / "records" / "offline")
    found = offline_folder(as_given(tmp_path / "src", form), tmp_path / "unpacked")
    assert found.name == "offline" and (found / run_id / "run.json").exists()


@pytest.mark.parametrize("form", FORMS)
def test_a_link_out_of_the_store_is_refused(tmp_path: Path, form: str) -> None:
    run_id = offline_store(tmp_path / "src")
    secret = tmp_path / "outside.txt"
    secret.write_text("not yours")
    os.symlink(secret, tmp_path / "src" / run_id / "artifacts" / "leak.txt")
    with pytest.raises(SourceRefused, match="refused"):
        offline_folder(as_given(tmp_path / "src", form), tmp_path / "unpacked")


@pytest.mark.parametrize("form", FORMS)
def test_a_run_json_that_is_no_run_is_refused_by_name(tmp_path: Path, form: str) -> None:
    run_id = offline_store(tmp_path / "src")
    meta = tmp_path / "src" / run_id / "run.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "status"}))
    with pytest.raises(SourceRefused, match=rf"{run_id}/run.json: not a run record \(missing status\)"):
        offline_folder(as_given(tmp_path / "src", form), tmp_path / "unpacked")


@pytest.mark.parametrize("form", FORMS)
def test_two_stores_in_one_source_are_refused(tmp_path: Path, form: str) -> None:
    offline_store(tmp_path / "src" / "a")
    offline_store(tmp_path / "src" / "b")
    with pytest.raises(SourceRefused, match="holds 2 offline stores"):
        offline_folder(as_given(tmp_path / "src", form), tmp_path / "unpacked")


def test_a_fifo_in_a_folder_is_refused(tmp_path: Path) -> None:
    run_id = offline_store(tmp_path / "src")
    os.mkfifo(tmp_path / "src" / run_id / "artifacts" / "pipe")
    with pytest.raises(SourceRefused, match="not a regular file"):
        offline_folder(tmp_path / "src", tmp_path / "unpacked")


def test_a_nested_folder_given_directly_is_imported(tmp_path: Path) -> None:
    run_id = offline_store(tmp_path / "src" / "records" / "offline")
    client, out = import_into(tmp_path / "src", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.data.tags["specws.imported_from"] == run_id and run.data.metrics["output_tok_s"] == 12.5


def test_a_leases_store_is_found_by_its_stem_xz_first(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no runs.tar.xz or runs.tar.gz in"):
        store_archive(tmp_path)
    (tmp_path / "runs.tar.gz").write_bytes(b"")
    assert store_archive(tmp_path).name == "runs.tar.gz"
    (tmp_path / "runs.tar.xz").write_bytes(b"")
    assert store_archive(tmp_path).name == "runs.tar.xz"
    with pytest.raises(FileNotFoundError, match="probe.tar.xz"):
        store_archive(tmp_path, "probe")


def test_a_journal_store_imports_as_its_readme_says(tmp_path: Path) -> None:
    client, out = import_into(ROOT / "docs" / "journal" / "2026-12-03-cpu" / "runs.tar.xz", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "6 runs in" in out.stdout
    (exp,) = [e for e in client.search_experiments() if e.name == "smollm2_135m@local"]
    assert len(client.search_runs([exp.experiment_id])) == 6


def test_runs_imported_into_a_store_elsewhere_keep_their_artifacts_beside_it(tmp_path: Path, monkeypatch) -> None:
    run_id = offline_store(tmp_path / "src")
    rows = [{"id": f"p{i}", "category": "grounded", "text": f"prompt {i}"} for i in range(6)]
    log_prompt_dataset(OfflineClient(tmp_path / "src"), run_id, "quick", "grounded", rows, "s" * 64, {"p1", "p4"})
    elsewhere, cwd = tmp_path / "elsewhere", tmp_path / "cwd"
    elsewhere.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    uri = f"sqlite:///{elsewhere / 'm.db'}"
    main([str(tmp_path / "src"), "--tracking-uri", uri])
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.artifact_uri.startswith((elsewhere / "artifacts").as_uri())
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"summary.json", "prompt_set.json"}
    assert not any(cwd.iterdir())    # nothing under the current directory (MLflow's ./mlruns default)
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.digest == measured_digest(rows, {"p1", "p4"})[:36] != "s" * 36
