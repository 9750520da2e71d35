"""experiments.moe.served_curve on real served results: the Kimi-K2.5-mini decode.json of the 2026-12-02 H200 run
(degenerate decode routing) and the small MoE's decode.json / ngram.json of 2026-11-30 (moe.tar.xz)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from experiments.analysis.speedup.model import load_expert_curve
from experiments.config.kimi import KIMI
from experiments.config.paths import ROOT
from experiments.moe import served_curve as sc

KIMI_DECODE = ROOT / "docs/journal/2026-12-02-h200/kimi_served/decode.json"
TINY_TAR = ROOT / "docs/journal/2026-11-30-h200b/moe.tar.xz"


def _points(passes: list[dict], mode: str) -> dict[int, float]:
    """Forward-weighted mean distinct experts per token count, read straight from the telemetry keys."""
    acc: dict[int, list[float]] = {}
    for p in passes:
        for key, s in p["telemetry"].items():
            if key.startswith(f"{mode}@tokens="):
                t = int(key.split("@")[1].removeprefix("tokens="))
                a = acc.setdefault(t, [0.0, 0.0])
                a[0] += s["mean_distinct"] * s["forwards"]
                a[1] += s["forwards"]
    return {t: s / f for t, (s, f) in acc.items()}


@pytest.fixture
def kimi_dir(tmp_path: Path) -> Path:
    shutil.copy(KIMI_DECODE, tmp_path / "decode.json")
    return tmp_path


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    """decode.json and ngram.json (k = 4, B = 32/16/8/4/2) of the small MoE (32 experts)."""
    with tarfile.open(TINY_TAR) as tar:
        for name in ("decode.json", "ngram.json"):
            member = tar.getmember(f"moe/{name}")
            member.name = name
            tar.extract(member, tmp_path, filter="data")
    return tmp_path


def test_kimi_curve_is_the_decode_telemetry_interpolated(kimi_dir: Path) -> None:
    passes = json.loads(KIMI_DECODE.read_text())["passes"]
    measured = _points(passes, "decode")
    curve = sc.expert_curve(kimi_dir)
    assert len(curve) == max(measured) == 64
    for t, d in measured.items():
        assert curve[t - 1] == pytest.approx(d)
    # 1 token: 256 forwards at c1 + 3 at c64, all 8 experts; 2 tokens: 16; 4 tokens: 8 -> 3 tokens halfway
    assert curve[:4] == pytest.approx([8.0, 16.0, 12.0, 8.0])
    assert curve[63] == pytest.approx(passes[3]["telemetry"]["decode@tokens=64@bs=64"]["mean_distinct"])


def test_tiny_curve_uses_decode_and_unbudgeted_verify_only(tiny_dir: Path) -> None:
    decode = json.loads((tiny_dir / "decode.json").read_text())["passes"]
    ngram = [p for c in json.loads((tiny_dir / "ngram.json").read_text())["configs"] for p in c["passes"]]
    assert {p["budget"] for p in ngram} == {32, 16, 8, 4, 2}
    verify = _points([p for p in ngram if p["budget"] == 32], "target_verify")
    measured = {**_points(decode, "decode"), **verify}
    assert sorted(measured) == [1, 4, 5, 8, 20, 40]    # decode bs 1/4/8, verify bs 1/4/8 x (k+1 = 5)
    points = sc.curve_points(tiny_dir)
    assert [t for t, _, _ in points] == sorted(measured)
    assert [d for _, d, _ in points] == pytest.approx([measured[t] for t, _, _ in points])
    curve = sc.expert_curve(tiny_dir)
    assert len(curve) == 40 and curve[0] == 4.0
    assert curve[39] == pytest.approx(6.922222, abs=1e-5)   # B = 32, not the capped B = 2 pass (2.0)
    assert min(curve) >= 4.0


def test_curve_file_is_what_load_expert_curve_reads(tiny_dir: Path, tmp_path: Path) -> None:
    curve = sc.expert_curve(tiny_dir)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(sc.curve_json(tiny_dir)))
    assert load_expert_curve(plain, KIMI.routed_experts, KIMI.top_k) == pytest.approx(curve)
    carried = tmp_path / "carried.json"
    carried.write_text(json.dumps(sc.curve_json(tiny_dir, experts=32, top_k=4)))
    assert load_expert_curve(carried, 32, 4) == pytest.approx(curve)
    # carried over to Kimi's 384 experts, top-8
    assert load_expert_curve(carried, KIMI.routed_experts, KIMI.top_k)[0] == pytest.approx(8.0)
    with pytest.raises(ValueError):
        sc.curve_json(tiny_dir, experts=32)


def test_kimi_step_table_rows(kimi_dir: Path) -> None:
    passes = json.loads(KIMI_DECODE.read_text())["passes"]
    rows = sc.step_table(kimi_dir)
    assert [r["concurrency"] for r in rows] == [p["concurrency"] for p in passes] == [1, 4, 16, 64]
    for r, p in zip(rows, passes, strict=True):
        assert (r["phase"], r["k"], r["budget"], r["partial"]) == ("decode", 0, None, False)
        assert r["step_ms"] == pytest.approx(1000 * p["wall_s"] * p["concurrency"] / p["output_tokens"])
        assert r["steps_s"] * r["step_ms"] == pytest.approx(1000)
        assert r["tok_s"] == p["tok_s"] and r["accept_length"] == 1.0
        assert r["distinct"] == p["telemetry"]["decode"]["mean_distinct"]
        assert r["step_ms_ratio"] is None and r["tok_s_ratio"] is None
    assert rows[3]["distinct"] == pytest.approx(26.378378, abs=1e-5)


def test_tiny_step_table_budget_ratios(tiny_dir: Path) -> None:
    rows = [r for r in sc.step_table(tiny_dir) if r["phase"] == "ngram"]
    assert len(rows) == 15 and {r["k"] for r in rows} == {4}
    ref = {r["concurrency"]: r for r in rows if r["budget"] == 32}
    configs = json.loads((tiny_dir / "ngram.json").read_text())["configs"]
    for r, p in zip(rows, configs[0]["passes"], strict=True):
        verifies = sum(q["spec_verify_ct"] for q in p["requests"])
        assert r["step_ms"] == pytest.approx(1000 * p["wall_s"] * p["concurrency"] / verifies)
        assert r["accept_length"] == p["accept_length_tokens_per_verify"]
        assert r["distinct"] == p["telemetry"]["target_verify"]["mean_distinct"]
        if r["budget"] == 32:
            assert r["step_ms_ratio"] is None and r["tok_s_ratio"] is None
        else:
            base = ref[r["concurrency"]]
            assert r["step_ms_ratio"] == pytest.approx(r["step_ms"] / base["step_ms"])
            assert r["tok_s_ratio"] == pytest.approx(r["tok_s"] / base["tok_s"])
    assert {r["distinct"] for r in rows if r["budget"] == 2} == {2.0}   # the cap, measured


def test_missing_phase_is_skipped(tiny_dir: Path) -> None:
    (tiny_dir / "decode.json").unlink()
    rows = sc.step_table(tiny_dir)
    assert rows and {r["phase"] for r in rows} == {"ngram"}
    assert sc.missing_phases(tiny_dir) == ["decode", "graphs"]
    assert sc.expert_curve(tiny_dir)[0] == pytest.approx(4.488194, abs=1e-5)   # first point: 5-token verify
    assert any(n.startswith("decode: not run") for n in sc.phase_notes(tiny_dir))


def test_partial_phase_is_used_and_marked(kimi_dir: Path) -> None:
    data = json.loads(KIMI_DECODE.read_text())
    (kimi_dir / "decode.json").write_text(json.dumps({**data, "complete": False}))
    rows = sc.step_table(kimi_dir)
    assert len(rows) == 4 and all(r["partial"] for r in rows)
    assert "decode*" in sc.markdown(rows)
    assert "decode: partial (complete: false), rows marked *" in sc.phase_notes(kimi_dir)


def test_cli_end_to_end(kimi_dir: Path) -> None:
    out = kimi_dir / "curve.json"
    run = subprocess.run([sys.executable, "-m", "experiments.moe.served_curve", str(kimi_dir), "--curve-out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "note: ngram: not run (no ngram.json), skipped" in run.stdout
    assert "note: graphs: not run (no graphs.json), skipped" in run.stdout
    table = [ln for ln in run.stdout.splitlines() if ln.startswith("| decode |")]
    assert len(table) == 4 and table[3].split("|")[4].strip() == "64"
    assert load_expert_curve(out, KIMI.routed_experts, KIMI.top_k) == pytest.approx(sc.expert_curve(kimi_dir))


def test_cli_refuses_a_folder_without_results(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "experiments.moe.served_curve", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "none of decode.json" in run.stderr


def test_telemetry_comparison_reads_unbudgeted_rows_and_the_budget_grid(tiny_dir: Path) -> None:
    from experiments.moe import telemetry
    result = {"points": [], "num_experts": 32, "continuations": {}}
    out = telemetry.served_comparison(result, tiny_dir)
    ngram = json.loads((tiny_dir / "ngram.json").read_text())
    budgeted = sum(1 for c in ngram["configs"] for p in c["passes"] if p.get("budget") not in (None, 32))
    assert budgeted, "the fixture should hold budgeted passes"
    verify = [r for r in out["rows"] if r["mode"] == "target_verify"]
    assert verify and {r["mode"] for r in out["rows"]} == {"decode", "target_verify"}
    unbudgeted = [p for c in ngram["configs"] for p in c["passes"] if p.get("budget") in (None, 32)]
    keys = [k for p in unbudgeted for k in p["telemetry"] if k.startswith("target_verify@tokens=")]
    assert len(verify) == len(keys) and {r["tokens"] for r in verify} == set(_points(unbudgeted, "target_verify"))
    grid = out["budget_grid"]
    assert len(grid) == sum(len(c["passes"]) for c in ngram["configs"])
    assert all(g["identical_to_unbudgeted"] == 1.0 for g in grid if g["budget"] == 32)
    assert {g["budget"] for g in grid} >= {32, 2}
