"""Artifact uploads that cannot take a measurement down: each write is tried on its own, the first failure is
kept, and the run is failed with it only once its metrics are logged."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from experiments.tracking.redact import redact_text

console = Console(stderr=True)


class ArtifactWriteFailed(RuntimeError):
    """An artifact of a run could not be written; its metrics were logged before, its records stay on disk."""


class Uploads:
    """The artifact writes of one run. `write` never raises: a failure is printed and kept, and `raise_first`
    raises the first one after the run's metrics are in the store (then the run ends FAILED with that reason)."""

    def __init__(self, client, run_id: str, records_path: Path | None = None) -> None:
        self.client, self.run_id, self.records_path = client, run_id, records_path
        self.failures: list[str] = []

    def write(self, what: str, upload: Callable[[], object]) -> bool:
        try:
            upload()
            return True
        except Exception as exc:  # noqa: BLE001 - a store or disk failure of any kind; the measurement goes on
            self.failures.append(f"{what}: {type(exc).__name__}: {redact_text(str(exc)).strip()[:500]}")
            console.print(f"[bold red]could not write {what}[/]: {exc}")
            return False

    def dict(self, data: dict | list, name: str) -> bool:
        return self.write(name, lambda: self.client.log_dict(self.run_id, data, name))

    def figure(self, make_figure: Callable[[], object], name: str) -> bool:
        return self.write(name, lambda: self.client.log_figure(self.run_id, make_figure(), name))

    def file(self, path: Path, folder: str) -> bool:
        return self.write(f"{folder}/{path.name}", lambda: self.client.log_artifact(self.run_id, str(path), folder))

    def folder(self, path: Path, folder: str) -> bool:
        return self.write(f"{folder}/", lambda: self.client.log_artifacts(self.run_id, str(path), folder))

    def raise_first(self) -> None:
        """ArtifactWriteFailed with the first failure (and how many followed) if any write failed."""
        if not self.failures:
            return
        more = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        kept = f"; the records are kept in {self.records_path}" if self.records_path else ""
        raise ArtifactWriteFailed(f"could not write artifact {self.failures[0]}{more}; the run's metrics are "
                                  f"logged{kept}")
