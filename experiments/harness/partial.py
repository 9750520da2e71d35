"""What a run stopped mid-workload (a level past its deadline, a server that died, Ctrl-C) still measured: the
records the client wrote before it stopped, read back from the records file and grouped into the slices they came
from. A slice's wall is taken from its records (the first send to the last answer's end: the client's own clock of
the level is gone with it), its engine counters are unknown, so no acceptance is computed from them."""
from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path

from experiments.harness.client import LevelResult, RequestRecord
from experiments.harness.summary import summarize
from experiments.tracking.records import RecordsError, load_records

PARTIAL_TAG = "specws.partial_summary"
_FIELDS = {f.name for f in fields(RequestRecord)}
log = logging.getLogger(__name__)


def levels_so_far(records_path: Path) -> list[LevelResult]:
    """One LevelResult per (concurrency, repetition) of the records in `records_path`, in their order; none
    when the file is missing, empty or unreadable."""
    try:
        rows = load_records(records_path) if records_path.exists() else []
    except (OSError, RecordsError):
        return []
    slices: dict[tuple[int, int], list[RequestRecord]] = {}
    for row in rows:
        rec = RequestRecord(**{k: v for k, v in row.items() if k in _FIELDS})
        slices.setdefault((rec.concurrency, rec.repetition), []).append(rec)
    return [LevelResult(c, _wall(recs), recs, None, None) for (c, _), recs in slices.items()]


def _wall(records: list[RequestRecord]) -> float:
    """From the slice's start to its last record's end (or send, for one that failed)."""
    ends = [(r.scheduled_s if r.scheduled_s is not None else r.start_s) + (r.e2e_s or 0.0) for r in records]
    return max([*ends, 0.0])


def describe(levels: list[LevelResult]) -> str:
    done = sum(len(lv.records) for lv in levels)
    return (f"{done} records of {len(levels)} slice(s) written before the run stopped; each slice's wall from its "
            "records, no engine counters")


def keep_partial(m, adapter) -> None:
    """Fill Measurement `m` of a run stopped mid-workload with the summary of its records so far (metrics tagged
    PARTIAL_TAG); a summary that cannot be made leaves `m` as it was, never hiding why the run stopped."""
    levels = levels_so_far(m.records_path)
    if not levels:
        return
    try:
        summary = summarize(levels, adapter)
    except Exception as exc:  # noqa: BLE001 - the run's own failure is the one to report
        log.warning("no summary of the records so far in %s: %s: %s", m.records_path, type(exc).__name__, exc)
        return
    m.summary, m.metrics = summary, dict(summary.metrics)
    m.tags[PARTIAL_TAG] = describe(levels)
