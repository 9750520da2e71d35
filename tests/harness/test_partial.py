"""experiments/harness/partial.py: the records a run stopped mid-workload wrote (as the workload client writes
them, one JSON line per RequestRecord) read back into slices per (concurrency, repetition), each slice's wall from
its records, the records file missing or broken, and the partial summary filled into a Measurement and tagged."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.engines import adapter_for
from experiments.harness.client import RequestRecord, dump_json
from experiments.harness.partial import PARTIAL_TAG, describe, keep_partial, levels_so_far
from experiments.tracking.export import Measurement

RECORDS = [
    RequestRecord(1, 0, "p1", [1, 2, 3], output_token_ids=[4, 5, 6], start_s=0.0, ttft_s=0.1, e2e_s=0.5,
                  chunk_times_s=[0.1, 0.3, 0.5], chunk_tokens=[1, 1, 1]),
    RequestRecord(1, 0, "p2", [1, 2], output_token_ids=[7, 8], start_s=0.5, ttft_s=0.1, e2e_s=0.7,
                  chunk_times_s=[0.1, 0.7], chunk_tokens=[1, 1]),
    RequestRecord(1, 1, "p1", [1, 2, 3], output_token_ids=[4], start_s=0.25, e2e_s=0.25),
    RequestRecord(4, 0, "p1", [1, 2, 3], start_s=0.0, scheduled_s=0.2, e2e_s=0.3, error="reset",
                  error_kind="connection"),
]


def _write(path: Path, records: list[RequestRecord], tail: str = "") -> Path:
    with path.open("w") as f:
        for rec in records:
            f.write(dump_json(vars(rec)) + "\n")   # as WorkloadRunner writes them
        f.write(tail)
    return path


def test_records_are_sliced_per_level_and_repetition_in_their_order(tmp_path: Path) -> None:
    levels = levels_so_far(_write(tmp_path / "r.jsonl", RECORDS))
    assert [(lv.concurrency, [r.prompt_id for r in lv.records]) for lv in levels] == \
        [(1, ["p1", "p2"]), (1, ["p1"]), (4, ["p1"])]
    assert all(lv.metrics_before is None and lv.metrics_after is None for lv in levels)


def test_a_slices_wall_runs_to_its_last_end_from_the_schedule_where_there_is_one(tmp_path: Path) -> None:
    walls = [lv.wall_s for lv in levels_so_far(_write(tmp_path / "r.jsonl", RECORDS))]
    assert walls == pytest.approx([1.2, 0.5, 0.5])


def test_a_record_cut_off_mid_write_is_skipped_and_unknown_fields_ignored(tmp_path: Path) -> None:
    row = dump_json({**vars(RECORDS[0]), "a_field_of_a_later_client": 1})
    path = tmp_path / "r.jsonl"
    path.write_text(row + "\n" + '{"concurrency": 1, "repet')
    levels = levels_so_far(path)
    assert [(lv.concurrency, len(lv.records)) for lv in levels] == [(1, 1)]


def test_no_levels_from_a_missing_empty_or_broken_file(tmp_path: Path) -> None:
    assert levels_so_far(tmp_path / "none.jsonl") == []
    assert levels_so_far(_write(tmp_path / "empty.jsonl", [])) == []
    broken = _write(tmp_path / "broken.jsonl", RECORDS[:1], tail="not json\n" + dump_json(vars(RECORDS[1])) + "\n")
    assert levels_so_far(broken) == []


def test_describe_counts_records_and_slices(tmp_path: Path) -> None:
    levels = levels_so_far(_write(tmp_path / "r.jsonl", RECORDS))
    assert describe(levels).startswith("4 records of 3 slice(s) written before the run stopped")


def test_keep_partial_fills_the_measurement_with_a_tagged_summary(tmp_path: Path) -> None:
    m = Measurement(_write(tmp_path / "r.jsonl", RECORDS))
    keep_partial(m, adapter_for("vllm"))
    assert m.summary is not None and m.tags[PARTIAL_TAG] == describe(levels_so_far(m.records_path))
    assert m.metrics["requests_c4"] == 0.0 and m.metrics["errors_c4"] == 1.0
    assert m.metrics["errors_by_kind/connection"] == 1.0


def test_keep_partial_without_records_leaves_the_measurement_as_it_was(tmp_path: Path) -> None:
    m = Measurement(tmp_path / "never-written.jsonl", metrics={"kept": 1.0})
    keep_partial(m, adapter_for("vllm"))
    assert (m.summary, m.metrics, m.tags) == (None, {"kept": 1.0}, {})
