"""The one JSON-lines reader: a cut-off last line is skipped and reported, any other bad line refused; a folder
of records files; a run's records read back from the store."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.records import RecordsError, load_records, read_jsonl, run_records


def test_cut_off_last_line_is_skipped_and_said(tmp_path: Path, caplog) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n\n" + json.dumps({"a": 2}) + "\n" + '{"a": 3, "tok')
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    assert "records.jsonl:4: last line cut off" in caplog.text


def test_other_bad_lines_are_refused_with_file_and_line(tmp_path: Path) -> None:
    middle = tmp_path / "middle.jsonl"
    middle.write_text('{"a": 1}\n{"a": \n{"a": 2}\n')
    with pytest.raises(RecordsError, match="middle.jsonl:2: not JSON"):
        read_jsonl(middle)
    ended = tmp_path / "ended.jsonl"   # a whole last line (newline written) that is no JSON is no cut-off write
    ended.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(RecordsError, match="ended.jsonl:2"):
        read_jsonl(ended)
    (tmp_path / "empty.jsonl").write_text("")
    assert read_jsonl(tmp_path / "empty.jsonl") == []


def test_folder_of_records_and_a_runs_records(tmp_path: Path) -> None:
    folder = tmp_path / "recs"
    folder.mkdir()
    (folder / "b.jsonl").write_text('{"n": 2}\n')
    (folder / "a.jsonl").write_text('{"n": 1}\n')
    (folder / "notes.txt").write_text("not records")
    assert load_records(folder) == [{"n": 1}, {"n": 2}]
    client = OfflineClient(tmp_path / "store")
    with_records = client.create_run("e").info.run_id
    client.log_artifact(with_records, str(folder / "a.jsonl"), "records")
    assert run_records(client, with_records) == [{"n": 1}]
    assert run_records(client, client.create_run("e").info.run_id) is None
