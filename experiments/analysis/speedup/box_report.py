"""What `python -m experiments.analysis.speedup.cli box` prints: the terms with their sources, the host overhead per
lease behind their ranges, the acceptance per drafter, the band table, where verification turns compute-bound, the
seed check and the sensitivity table (experiments/analysis/speedup/box.py)."""
from __future__ import annotations

from experiments.analysis.speedup import box as bx
from experiments.analysis.speedup import box_compute, box_hosts
from experiments.analysis.speedup import box_terms as bt
from experiments.analysis.speedup.box_terms import DRAFTERS, BandUnavailable

MARK = {"pays": "P", "does not pay": "N", "inconclusive": "?"}


def _fmt(x: float) -> str:
    return f"{x:g}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def terms_table(variant: bx.Variant) -> list[str]:
    lines = ["| term | low | mid | high | unit | source |", "|---|---|---|---|---|---|"]
    for t in variant.terms().values():
        pinned = "" if t.ranged or t.name not in dict(variant.pinned) else " (pinned by the variant)"
        lines.append(f"| {t.name} | {_fmt(t.low)} | {_fmt(t.mid)} | {_fmt(t.high)} | {t.unit} | {t.source}{pinned} |")
    lines.append(f"| verify graph cap | 32 | 32 | 32 | batch | conf/site/blackwell.yaml: speculative runs capture "
                 f"graphs to batch {bt.VERIFY_GRAPH_CAP} (box_memory: verify graphs at 128 do not fit at 0.88); the "
                 f"baseline to {bt.DECODE_GRAPH_CAP} |")
    return lines


def acceptance_table() -> list[str]:
    lines = ["| drafter | tokens per step (low / mid / high) | source |", "|---|---|---|"]
    lines.append("| n-gram (A) | " + "; ".join(
        f"{k} draft tokens: " + " / ".join(f"{x:.2f}" for x in bt.ngram_accept(k)) for k in bt.NGRAM_CHAIN)
        + f" | {bt.NGRAM_SOURCE} |")
    for d in DRAFTERS.values():
        if d.accept is None:
            lines.append(f"| {d.key} | not predicted | {d.source} |")
            continue
        steps = "; ".join(f"{s} steps: " + " / ".join(f"{x:.2f}" for x in bt.eagle_accept(d, s)) for s in (1, 3, 5))
        lines.append(f"| {d.key} | {steps} | {d.source}; other step counts: the 3-step figure read as an i.i.d. "
                     "per-token acceptance |")
    return lines


def band_table(variant: bx.Variant, levels: tuple[int, ...]) -> tuple[list[str], list[bx.Band], list[str]]:
    head = "| configuration | tokens/step | " + " | ".join(f"c={c}" for c in levels) + " | corners kept / dropped |"
    lines = [head, "|---" * (len(levels) + 3) + "|"]
    bands, refused = [], []
    for spec in bx.configs():
        try:
            b = bx.band(spec, variant, levels)
        except BandUnavailable as exc:
            if str(exc) not in refused:
                refused.append(str(exc))
            continue
        bands.append(b)
        cells = [f"{b.point[c]:.2f} [{b.low[c]:.2f}-{b.high[c]:.2f}] {MARK[b.verdict(c)]}" for c in levels]
        lines.append(f"| {spec.label} | {b.accept[0]:.2f}-{b.accept[2]:.2f} | " + " | ".join(cells)
                     + f" | {len(b.corners)} / {b.dropped} |")
    return lines, bands, refused


def sensitivity_table(variant: bx.Variant, bands: list[bx.Band], levels: tuple[int, ...]) -> list[str]:
    """Per cell: the band's verdict and the terms that settle it where it straddles 1; then the point's verdict and
    the terms whose low or high end, the others at mid, move the point across 1."""
    lines = ["| configuration | " + " | ".join(f"c={c}" for c in levels) + " |", "|---" * (len(levels) + 1) + "|"]
    counts: dict[str, int] = {}
    for b in bands:
        flips = bx.sensitivity(b.spec, variant, levels)
        cells = []
        for c in levels:
            cells.append(_sensitivity_cell(b, c, flips[c]))
            for name in {*(x.rstrip("+-") for pin in b.kept_open_by(c) for x in pin.split(" & ")), *flips[c]}:
                counts[name] = counts.get(name, 0) + 1
        lines.append(f"| {b.spec.label} | " + " | ".join(cells) + " |")
    lines += ["", "cells where a term keeps the band open or flips the point: "
              + ", ".join(f"{n} {k}" for n, k in sorted(counts.items(), key=lambda x: (-x[1], x[0])))]
    return lines


def _sensitivity_cell(b: bx.Band, c: int, flips: list[str]) -> str:
    band = MARK[b.verdict(c)]
    if band == "?":
        band += f" kept open by {', '.join(b.kept_open_by(c)) or 'no single term or pair'}"
    point = ("P" if b.point[c] > 1.0 else "N") + (f" by {', '.join(flips)}" if flips else "")
    return f"{band}; point {point}"


SENSITIVITY_HEAD = (
    "## Sensitivity: the band's verdict (P / N / ?); where it straddles 1 (?), the terms that keep it open: each "
    "pinned at one end (name- its low, name+ its high), the other terms still over their ranges, would close the "
    "cell to P or N, so it is that term's range that leaves the verdict open and measuring it could decide it "
    "('a- & b+': no single term does, that pair pinned together would). Then the point's verdict and the terms whose "
    "low or high end (the others at mid) flip it. host: the engine's fixed cost per speculative step, ranged over "
    "the hosts seen (## Host overhead); ovh/seq: its cost per sequence")


def host_table() -> list[str]:
    ngram, eagle = (bt.TERMS[n] for n in ("ngram_overhead_ms", "eagle3_overhead_ms"))
    return ["## Host overhead: SGLang's fixed cost per speculative step, fitted per lease (experiments/analysis/"
            "speedup/box_hosts.py, graphs regime, ms; engine's own: less the EAGLE-3 head's weights read; step time: "
            "stepcost's, every chunk interval counted)",
            *box_hosts.markdown(), "",
            f"carried to the box in ms as `host` (the box's own CPU never ran it): ngram_overhead_ms "
            f"{_fmt(ngram.low)}-{_fmt(ngram.high)} (mid {_fmt(ngram.mid)}), eagle3_overhead_ms "
            f"{_fmt(eagle.low)}-{_fmt(eagle.high)} (mid {_fmt(eagle.mid)}); the per-sequence terms stay the Kimi "
            "miniature's"]


def render(variant: bx.Variant, levels: tuple[int, ...] = bx.LEVELS) -> str:
    base = bx.mids(variant)
    gamma, _ = bx.calibrate(base, variant.marlin)
    t128 = bx.target_ms(base, variant.marlin, bt.PLATEAU_C, 1.0, gamma, 1.0)
    out = [f"# Kimi-K2.5 on the Blackwell box: speedup bands ({variant.name})", "",
           f"baseline at mid: {bx.T1:.2f} ms/step at c=1, {t128:.1f} ms at c={bt.PLATEAU_C} "
           f"({bt.PLATEAU_C * 1000 / t128:.0f} tok/s, measured {bt.PLATEAU_TOK_S:.0f}); attention growth "
           f"{gamma:.4f}/sequence fitted to it; communication {bx.comm_ms_per_token(base['bus_gbps']):.4f} ms per "
           "token in the step", "", "## Terms", *terms_table(variant), "", *host_table(), "", "## Acceptance",
           *acceptance_table(), ""]
    lines, bands, refused = band_table(variant, levels)
    out += ["## Bands: point [low-high] per concurrency; P pays (band above 1), N does not pay (below), "
            "? inconclusive (straddles 1)", *lines, ""]
    out += [f"not predicted: {r}" for r in refused]
    out += ["", "C is against vLLM's own baseline (MoE on Triton W4A16); against the box's SGLang baseline multiply by "
            "vLLM's baseline speed over SGLang's (mid): " + ", ".join(f"c={c} {bx.engine_factor(variant, c):.2f}"
                                                                       for c in levels)]
    out += ["", "## Compute-bound verification: tokens per step (c sequences x q verified) past which the GEMMs' "
            "flops exceed the dense + MoE weights' read", *box_compute.table(variant, bx.configs())]
    seed = bx.seed_check(variant, levels)
    out += ["", f"## Seed check: n-gram measured {bx.SEED_MEASURED[0]}-{bx.SEED_MEASURED[1]}x on the box",
            f"A at 4 draft tokens, reasoning acceptance {seed.band.accept[0]:.2f} / {seed.band.accept[1]:.2f} / "
            f"{seed.band.accept[2]:.2f}: {'reproduces' if seed.reproduces else 'does NOT reproduce'}: {seed.reason}",
            "points: " + ", ".join(f"c={c} {seed.band.point[c]:.2f}" for c in levels), ""]
    out += [SENSITIVITY_HEAD, *sensitivity_table(variant, bands, levels)]
    return "\n".join(out)
