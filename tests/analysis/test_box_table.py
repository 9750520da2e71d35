"""The box table from ranged terms: every term has a source or a range, the seed's n-gram loss is reproduced under
every variant the CLI offers (and the first model's assumptions fail the same check), bands contain their points,
the sensitivity names the terms that keep a verdict open, the host overhead spans every SGLang host measured, the
compute-bound crossover follows the terms, and what nobody measured or bounded is refused."""
from __future__ import annotations

import math

import pytest
from conftest import compose_cfg

from experiments.analysis.speedup import box as bx
from experiments.analysis.speedup import box_compute as bc
from experiments.analysis.speedup import box_hosts as bh
from experiments.analysis.speedup import box_terms as bt
from experiments.analysis.speedup.box_terms import DRAFTERS, TERMS, BandUnavailable, Term
from experiments.analysis.speedup.cli import main
from experiments.analysis.speedup.model import load_expert_curve
from experiments.config.paths import ROOT
from experiments.config.views import typed_run
from experiments.harness.launch import build_launch_spec

JOURNAL = ROOT / "docs/journal/2026-12-02-h200"
VARIANTS = {
    "uniform": bx.uniform_variant,
    "served curve": lambda: bx.curve_variant(
        load_expert_curve(JOURNAL / "kimi_lease2/served_expert_curve.json", bt.EXPERTS, bt.TOP_K), "served"),
    "H200 kernel times": lambda: bx.kernel_variant(JOURNAL / "kimi_kernels.json"),
}
A4 = bx.Spec("A", "ngram", "sglang", 4)


def test_every_term_has_a_source_and_a_range_or_one_measured_value() -> None:
    for t in TERMS.values():
        assert t.low <= t.mid <= t.high and len(t.source) > 40, t.name
    with pytest.raises(ValueError, match="no range"):
        Term("vllm_verify_ms", "ms", None, None, None, "vLLM's verify step on the box: never measured")  # type: ignore
    with pytest.raises(ValueError, match="no range"):
        Term("x", "ms", 1.0, math.nan, 2.0, "a range whose middle nobody gave")
    with pytest.raises(ValueError, match="low <= mid <= high"):
        Term("x", "ms", 2.0, 1.0, 3.0, "a middle outside its own range")
    with pytest.raises(ValueError, match="no source"):
        Term("x", "ms", 1.0, 1.0, 1.0, "")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_seeds_ngram_loss_is_reproduced_under_every_variant(name: str) -> None:
    check = bx.seed_check(VARIANTS[name]())
    assert check.reproduces, check.reason
    lo, hi = bx.SEED_MEASURED
    assert all(check.band.low[c] <= hi and check.band.high[c] >= lo for c in bx.LEVELS)
    assert max(check.band.point.values()) < 1.1 and check.band.point[16] < 1.0


def test_the_first_models_assumptions_fail_the_same_check() -> None:
    """No engine overhead per step, verification costing nothing in attention or eager launches, MoE as the H200's
    kernel curve: the model that said n-gram pays must not pass."""
    first = bx.kernel_variant(JOURNAL / "kimi_kernels.json")
    pinned = (*first.pinned, ("ngram_overhead_ms", 0.0), ("ngram_overhead_seq_ms", 0.0),
              ("attn_verify_growth", 0.0), ("eager_ms_per_layer", 0.0))
    check = bx.seed_check(bx.Variant("first model", first.marlin, first.triton, pinned))
    assert not check.reproduces and "pays" in check.reason


def test_every_band_contains_its_point_and_only_what_was_never_bounded_is_refused() -> None:
    variant = bx.uniform_variant()
    refused = set()
    for spec in bx.configs():
        try:
            b = bx.band(spec, variant)
        except BandUnavailable as exc:
            refused.add(spec.drafter)
            assert "no published accept length" in str(exc)
            continue
        for c in bx.LEVELS:
            assert b.low[c] <= b.point[c] <= b.high[c], (spec.label, c)
    assert refused == {"aq_medai_k25"} and DRAFTERS["aq_medai_k25"].accept is None
    with pytest.raises(BandUnavailable, match="3 draft tokens"):
        bx.band(bx.Spec("A", "ngram", "sglang", 3), variant)


def test_sensitivity_names_the_terms_that_decide_single_stream_ngram() -> None:
    variant = bx.uniform_variant()
    b = bx.band(A4, variant, (1, 2, 64))
    assert b.verdict(1) == "inconclusive" and b.verdict(64) == "does not pay"
    assert b.settled_by(64) == [] and b.kept_open_by(64) == []
    assert {"moe-", "attn+"} <= set(b.settled_by(2)) and b.kept_open_by(2) == b.settled_by(2)
    # with the host overhead ranged over every host seen, no single term closes c = 1: pairs keep it open
    assert b.settled_by(1) == [] and "attn+ & host+" in b.kept_open_by(1)
    flips = bx.sensitivity(A4, variant, (1, 64))
    assert {"attn", "moe", "accept", "host"} <= set(flips[1]) and flips[64] == []


def test_the_baseline_reproduces_the_measured_single_stream_and_plateau() -> None:
    variant = bx.uniform_variant()
    v = bx.mids(variant)
    gamma, ok = bx.calibrate(v, variant.marlin)
    assert ok and gamma > 0
    assert bx.target_ms(v, variant.marlin, 1, 1, gamma, 1.0) == pytest.approx(1000 / 82.5)
    assert 128_000 / bx.target_ms(v, variant.marlin, 128, 1, gamma, 1.0) == pytest.approx(1536)
    # a corner whose baseline alone is far slower than the plateau contradicts it: dropped from the bands
    worst = v | {"bus_gbps": 20.0, "moe_fixed_share": 0.0, "gemm_tflops": 120.0}
    assert not bx.calibrate(worst, variant.marlin)[1]


def test_verification_grows_attention_moe_and_all_reduce_with_the_tokens_verified() -> None:
    variant = bx.uniform_variant()
    v = bx.mids(variant)
    gamma, _ = bx.calibrate(v, variant.marlin)
    steps = [bx.target_ms(v, variant.marlin, 4, q, gamma, 1.0) for q in (1, 2, 4, 8)]
    assert steps == sorted(steps) and len(set(steps)) == 4
    flat = bx.target_ms(v | {"attn_verify_growth": 0.0}, variant.marlin, 4, 4, gamma, 1.0)
    assert flat < steps[2]


def test_eager_verification_costs_only_above_the_speculative_graph_cap() -> None:
    variant, spec = bx.uniform_variant(), bx.Spec("B", "eagle3", "sglang", 3, "lightseek_k25")
    v = bx.mids(variant)
    for c in (32, 64):
        cheap = bx.speedup(v | {"eager_ms_per_layer": 0.05}, variant, spec, c, 3.0, bt.VOCAB)
        dear = bx.speedup(v | {"eager_ms_per_layer": 0.6}, variant, spec, c, 3.0, bt.VOCAB)
        assert (cheap == dear) == (c <= bt.VERIFY_GRAPH_CAP)
    vllm = bx.Spec("C", "eagle3", "vllm", 3, "lightseek_k25")   # vLLM's piecewise graphs cover 128 x 4 tokens
    assert bx.spec_extra_ms(v | {"eager_ms_per_layer": 0.6}, vllm, 64, bt.VOCAB) == \
        bx.spec_extra_ms(v | {"eager_ms_per_layer": 0.05}, vllm, 64, bt.VOCAB)


def test_the_draft_costs_what_it_reads_per_step() -> None:
    layer, fc = bt.draft_bytes_per_rank(bt.VOCAB)
    assert layer > bt.VOCAB * bt.HIDDEN * 2 / bt.GPUS           # the 163,840-token LM head alone, per rank
    assert bt.draft_bytes_per_rank(32_000)[0] < layer / 2 and fc > 0
    v = bx.mids(bx.uniform_variant())
    slow, fast = (bx.draft_ms(v | {"draft_tbps": x}, 3, 1, 4, bt.VOCAB) for x in (0.9, 1.6))
    assert slow > fast > 3 * layer / 1.6e12 * 1e3
    # the miniature's fitted EAGLE-3 overhead held its own draft: what is left for the engine is smaller
    assert 0 < TERMS["eagle3_overhead_ms"].low < TERMS["eagle3_overhead_ms"].high < 3.53


def test_kernel_fit_constants_are_the_committed_kernel_table() -> None:
    for kernel in ("marlin_w4a16", "triton_w4a16"):
        fit, times = bx.kernel_fit(JOURNAL / "kimi_kernels.json", kernel)
        assert fit == pytest.approx(bt.MOE_FIT[kernel], rel=1e-3, abs=1e-3)
    marlin, triton = (bx.kernel_fit(JOURNAL / "kimi_kernels.json", k)[1][0][1] for k in ("marlin_w4a16",
                                                                                      "triton_w4a16"))
    assert triton / marlin == pytest.approx(bt.TRITON_OVER_MARLIN_1)


def test_graph_caps_are_the_box_sites() -> None:
    def cap(option: str) -> int:
        args = build_launch_spec(typed_run(compose_cfg("site=blackwell", f"+option={option}"))).args
        return int(args[args.index("--cuda-graph-max-bs-decode") + 1])
    assert cap("baseline") == bt.DECODE_GRAPH_CAP
    assert cap("A") == cap("B") == cap("E") == bt.VERIFY_GRAPH_CAP


def test_the_host_overhead_ranges_cover_every_sglang_host_measured() -> None:
    """Every SGLang lease store in the journal has its fits in box_hosts.HOSTS, and the box's fixed overhead terms
    span exactly what those hosts measured (engine's own: less the EAGLE-3 head's read), in ms."""
    stores = {p.parent.relative_to(ROOT / "docs/journal").as_posix()
              for p in (ROOT / "docs/journal").rglob("runs.tar.xz") if "cpu" not in p.parent.name}
    assert {h.lease for h in bh.HOSTS} == stores and all((ROOT / h.store).exists() for h in bh.HOSTS)
    for method, name in (("ngram", "ngram_overhead_ms"), ("eagle3", "eagle3_overhead_ms")):
        term, hosts = TERMS[name], bh.of(method)
        assert len({h.lease for h in hosts}) >= 6 and term.short == "host"
        for h in hosts:
            assert term.low <= h.own_ms[0] <= h.own_ms[1] <= term.high, (name, h.lease, h.option)
            assert h.share == pytest.approx(h.over_ms / h.decode_ms) and h.lease.split("/")[-1] in term.source
        assert term.low == pytest.approx(min(h.own_ms[0] for h in hosts), abs=1e-3)
        assert term.high == pytest.approx(max(h.own_ms[1] for h in hosts), abs=1e-3)
        assert "unknown" in term.source and "share" in term.source
    assert TERMS["ngram_overhead_ms"].mid == 2.34   # the Kimi miniature over both leases, as before
    kimi = [h for h in bh.of("ngram") if h.model == "kimi_k25_mini"]
    assert min(h.over_ms for h in kimi) <= TERMS["ngram_overhead_ms"].mid <= max(h.over_ms for h in kimi)
    assert TERMS["vllm_overhead_ms"].high == TERMS["eagle3_overhead_ms"].high   # "mid/high: SGLang's"


def test_the_compute_bound_crossover_comes_from_the_terms() -> None:
    variant = bx.uniform_variant()
    v, shape = bx.mids(variant), variant.marlin
    n = bc.crossover_tokens(v, shape)
    assert bx.flops_ms(v, n) == pytest.approx(bx.weights_ms(v, shape, n, 1.0), rel=1e-6)
    assert bx.flops_ms(v, n * 0.9) < bx.weights_ms(v, shape, n * 0.9, 1.0)
    # faster GEMMs move it up, a larger fixed MoE share (less MoE growth with tokens) down
    tflops = [bc.crossover_tokens(v | {"gemm_tflops": x}, shape) for x in (120.0, 200.0, 300.0)]
    assert tflops == sorted(tflops) and len(set(tflops)) == 3
    assert bc.crossover_tokens(v | {"moe_fixed_share": 0.75}, shape) < n
    # the range is over the terms' ends: pinning gemm_tflops pins that end of it
    cross = bc.crossover(variant)
    assert cross.low <= cross.mid <= cross.high and cross.mid == pytest.approx(n)
    for x in (120.0, 300.0):
        pinned = bc.crossover(bx.Variant("pinned", variant.marlin, variant.triton, (("gemm_tflops", x),)))
        assert pinned.mid == pytest.approx(bc.crossover_tokens(v | {"gemm_tflops": x}, shape))
    assert bc.crossover(bx.Variant("slow", variant.marlin, variant.triton, (("gemm_tflops", 120.0),))).mid < \
        cross.mid < bc.crossover(bx.Variant("fast", variant.marlin, variant.triton, (("gemm_tflops", 300.0),))).mid
    # c = 128 x 4 verified tokens: 512 per step, below the mid crossover on SGLang's Marlin, past its low corner
    assert cross.low < 512 < cross.mid and cross.where(512).startswith("no at mid")
    assert bc.crossover(variant, "vllm").mid > cross.mid   # vLLM's Triton MoE reads more per token


def test_cli_box_prints_the_band_and_sensitivity_tables(capsys) -> None:
    main(["box", "--concurrency", "1", "64"])
    out = capsys.readouterr().out
    assert "## Bands" in out and "## Sensitivity" in out and "| A n-gram, 4 draft tokens |" in out
    assert "Seed check" in out and "reproduces" in out and "not predicted: aq_medai_k25" in out
    assert "verification turns compute-bound at 1,499 tokens per step (range 321-" in out
    assert "| A n-gram, 4 draft tokens | 4 | 256: no, at no corner | 512: no at mid, yes at some corners |" in out
    ngram, h100 = TERMS["ngram_overhead_ms"], next(h for h in bh.HOSTS if h.gpu == "H100")
    assert "## Host overhead" in out and f"| ngram_overhead_ms | {ngram.low:g} | 2.34 | {ngram.high:g} |" in out
    assert f"| {h100.lease} | H100 | smollm2_135m | B | {h100.over_ms:.2f} |" in out
    assert "kept open by" in out and "host+" in out and "keep it open" in out
    with pytest.raises(SystemExit):
        main(["box", "--expert-curve", "a.json", "--moe-kernel", "b.json"])
