"""A slimmed store keeps every member but the plots, byte for byte and in order, and still imports."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

from experiments.config.paths import ROOT
from experiments.tracking.slim_store import slim

JOURNAL_STORE = ROOT / "docs" / "journal" / "2026-12-03-cpu" / "runs.tar.xz"


def _store(path: Path) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [("runs/r1/run.json", b'{"id": "r1"}'), ("runs/r1/artifacts/plots/sweep.png", b"\x89PNG"),
                           ("runs/r1/artifacts/records/records-r1.jsonl", b'{"ok": true}\n'),
                           ("runs/r1/artifacts/server/server-1.log", b"started\n")]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("runs/r2")
        link.type, link.linkname = tarfile.SYMTYPE, "r1"
        tar.addfile(link)


def _members(path: Path) -> list[tuple[str, bytes | None, int]]:
    with tarfile.open(path, "r:*") as tar:
        return [(m.name, tar.extractfile(m).read() if m.isfile() else m.linkname.encode(), m.mtime) for m in tar]


def test_plots_leave_and_everything_else_stays(tmp_path: Path) -> None:
    src = tmp_path / "runs.tar.gz"
    _store(src)
    full = _members(src)
    result = slim(src)
    out = tmp_path / "runs.tar.xz"
    assert not src.exists() and out.exists() and result["dropped"] == 1
    assert _members(out) == [m for m in full if not m[0].endswith(".png")]


def test_a_journal_store_slimmed_again_is_unchanged(tmp_path: Path) -> None:
    """The committed stores are slim already: nothing to drop, the same members."""
    copy = tmp_path / "runs.tar.xz"
    copy.write_bytes(JOURNAL_STORE.read_bytes())
    assert slim(copy)["dropped"] == 0
    assert _members(copy) == _members(JOURNAL_STORE)
