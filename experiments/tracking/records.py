"""JSON-lines files -- per-request records, prompt sets, cached EAGLE-3 answers, the offline store's metrics --
read by one reader, and a run's records read back from its `records/` artifacts."""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RecordsError(ValueError):
    """A JSON-lines file with a line that is not JSON; the message names the file and the line."""


def read_jsonl(path: Path | str) -> list[Any]:
    """Every non-empty line of `path`, parsed. A last line that does not parse and has no newline after it is
    a write cut off (the writer died mid-record): skipped, with a warning that says so. Any other line that
    does not parse raises RecordsError."""
    text = Path(path).read_text()
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1 and not text.endswith("\n"):
                log.warning("%s:%d: last line cut off (%s); skipped it", path, n, exc)
                break
            raise RecordsError(f"{path}:{n}: not JSON ({exc})") from exc
    return rows


def load_records(path: Path | str) -> list[dict]:
    """The records of one records file, or of every `*.jsonl` file of a folder in name order."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return [row for f in files for row in read_jsonl(f)]


def run_records(client: Any, run_id: str) -> list[dict] | None:
    """A run's per-request records, read back from its `records/` artifacts (MlflowClient or OfflineClient);
    None when it has none."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(client.download_artifacts(run_id, "records", tmp))
        except Exception:  # noqa: BLE001 - MLflow raises several kinds for a missing artifact
            return None
        if not any(local.glob("*.jsonl")):
            return None
        return load_records(local)
