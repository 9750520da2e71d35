"""The host-side cost of a speculative step, measured on every SGLang host in the journal: the data behind the box's
`ngram_overhead_ms` and `eagle3_overhead_ms` ranges (experiments/analysis/speedup/box_terms.py).

Per lease (one leased host) and option, the fixed cost per speculative step that `stepcost.fit_profile(...,
unit="ms")` fits in the CUDA-graph regime over that lease's baselines and that option's runs alone: n-gram (A)
`over_ms`; EAGLE-3 (B, E) `eagle_over_ms` + 3 `draft_ms` (3 draft steps, as the box's B; verification's growth folded
into its own per-sequence term: the leases' n-gram fits are left out, h200b's b_tok of 0.57 ms from four points would
turn its EAGLE-3 excess negative). Step time as stepcost measures it (`mean_step_ms`: every chunk interval counted).
`decode_ms`: the host's baseline decode step at c = 1, the mean of the baselines paired with the fitted runs (not the
fit's decode(1): Kimi lease 2's includes a Triton-forced baseline that no speculative run pairs with).
`head_read_ms`: the time the EAGLE-3 head's weights take to read per step on that GPU (3 forwards of its layer and LM
head, its fc once) at 4.3 and 3.3 TB/s on the H200 (as box_terms prices the miniature's head; the same shares of the
H100's 3.35 TB/s). The fitted figure holds it; the box prices its own draft apart.

HOSTS was written by `python -m experiments.analysis.speedup.box_hosts` (it opens the lease stores, minutes on a
cold cache); the CLI reads only the committed table. Stores: docs/journal/<lease>/runs.tar.xz (the Kimi miniature:
docs/journal/2026-12-02-h200/kimi_lease2|kimi_lease3/runs.tar.xz). The vLLM leases (CPU) are no SGLang hosts.
"""
from __future__ import annotations

import argparse
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostFit:
    """One lease's fitted fixed cost per speculative step for one option (graphs regime, absolute ms)."""
    lease: str                          # journal folder of the store, relative to docs/journal
    gpu: str
    model: str
    option: str                         # A: SGLang NGRAM; B: EAGLE-3; E: EAGLE-3 with the MoE expert budget
    over_ms: float                      # fitted fixed cost per speculative step
    over_seq_ms: float                  # the same fit's cost per sequence in the batch
    decode_ms: float                    # the host's baseline decode step at c = 1
    head_read_ms: tuple[float, float]   # the EAGLE-3 head's weights read per step (fast, slow end); n-gram 0
    runs: tuple[str, ...]               # speculative runs fitted (first 8 hex of the run id)
    levels: tuple[int, ...]             # concurrencies fitted
    unseparated: tuple[str, ...] = ()   # terms the lease's runs could not tell apart (stepcost)
    residual: float = 0.0               # the fit's RMS error over its speculative steps, relative

    @property
    def method(self) -> str:
        return "ngram" if self.option == "A" else "eagle3"

    @property
    def share(self) -> float:
        """The fitted fixed cost as a share of the host's baseline decode step."""
        return self.over_ms / self.decode_ms

    @property
    def own_ms(self) -> tuple[float, float]:
        """The engine's own cost: the fitted figure less what the head read (low: the slow read, high: the fast)."""
        return self.over_ms - self.head_read_ms[1], self.over_ms - self.head_read_ms[0]

    @property
    def store(self) -> str:
        return f"docs/journal/{self.lease}/runs.tar.xz"


# written by main() from the stores; the run ids are the stores' own. Step time: stepcost.mean_step_ms, every chunk
# interval counted (other requests' prefill pauses included)
HOSTS: tuple[HostFit, ...] = (
    HostFit("2026-11-30-h200b", "H200", "smollm2_135m", "A", 1.027, 0.0, 1.803, (0.0, 0.0), ("4578d2dc", "e1716910"),
            (1, 4), (), 0.746),
    HostFit("2026-11-30-h200b", "H200", "smollm2_135m", "B", 1.403, 0.658, 1.736, (0.015, 0.019), ("475ec6a7",
            "e81b5515"), (1, 4), ("draft",), 0.23),
    HostFit("2026-11-30-h200c", "H200", "smollm2_135m", "A", 1.186, 0.084, 1.115, (0.0, 0.0), ("10e02db4", "3990aa99",
            "5d758d63", "a8ffc7e5", "b8670ccc", "c2e3ae6a"), (1, 4, 8), (), 0.054),
    HostFit("2026-11-30-h200c", "H200", "smollm2_135m", "B", 0.94, 0.117, 1.112, (0.015, 0.019), ("013f5c46",
            "1347a5ee", "27e9186b", "400e1ad3", "47692626", "8fb10d14", "bc877f1a", "ed092914"), (1, 4, 8), (), 0.045),
    HostFit("2026-12-01-h200", "H200", "smollm2_135m", "A", 2.316, 0.0, 1.272, (0.0, 0.0), ("06f92427", "15e3e8da",
            "772b195b", "bd35ed3a", "c3f1f781", "cd5d399d", "ded556a6"), (1, 4, 8), (), 0.166),
    HostFit("2026-12-01-h200", "H200", "smollm2_135m", "B", 2.741, 0.214, 1.299, (0.015, 0.019), ("0b345662",
            "3b3441dc", "3b6c2dd9"), (1, 4, 8), ("draft",), 0.163),
    HostFit("2026-12-02-h200/kimi_lease2", "H200", "kimi_k25_mini", "A", 2.615, 0.191, 1.591, (0.0, 0.0), ("3d4a7b34",
            "53ffbd91", "7cd5f4c6"), (1, 4, 16, 64), (), 0.218),
    HostFit("2026-12-02-h200/kimi_lease3", "H200", "kimi_k25_mini", "A", 2.021, 0.237, 1.555, (0.0, 0.0), ("3e76d8f7",
            "816f6d18"), (1, 4, 16, 64), (), 0.106),
    HostFit("2026-12-02-h200/kimi_lease3", "H200", "kimi_k25_mini", "B", 4.176, 0.182, 1.555, (2.653, 3.457),
            ("1a1192ec",), (1, 4, 16, 64), ("draft",), 0.086),
    HostFit("2026-12-02-h200/kimi_lease3", "H200", "kimi_k25_mini", "E", 3.559, 0.141, 1.555, (2.653, 3.457),
            ("f9785083",), (1, 4, 16, 64), ("draft",), 0.063),
    HostFit("2026-12-03-h200", "H200", "smollm2_135m", "A", 1.891, 0.0, 1.273, (0.0, 0.0), ("2fa25f70", "35f1af93",
            "92ba2955"), (1, 4, 16), (), 0.195),
    HostFit("2026-12-04-h200", "H200", "smollm2_135m", "A", 1.308, 0.0, 1.13, (0.0, 0.0), ("862d741c",), (1, 4, 16),
            ("b_tok",), 0.011),
    HostFit("2026-12-04-h200", "H200", "smollm2_135m", "B", 1.426, 0.234, 1.13, (0.015, 0.019), ("12553fad",
            "ad4c915b", "e8d2f688"), (1, 4, 16), (), 0.066),
    HostFit("2026-12-05-h100", "H100", "smollm2_135m", "B", 2.504, 0.097, 1.459, (0.021, 0.028), ("87e61f1c",
            "90b8fa00", "a1ddf9a3"), (1, 8), ("draft",), 0.188),
    HostFit("2026-12-05-h200-d", "H200", "smollm2_135m", "B", 2.255, 0.1, 1.445, (0.015, 0.019), ("09167a76",
            "222c4a54", "90ccf732", "e87dcbef"), (1, 16), ("draft",), 0.236),
)


def of(method: str) -> list[HostFit]:
    return [h for h in HOSTS if h.method == method]


def overhead_range(method: str) -> tuple[float, float]:
    """(lowest, highest) engine-own fixed cost per step over every host that measured `method`."""
    rows = of(method)
    return min(h.own_ms[0] for h in rows), max(h.own_ms[1] for h in rows)


def seq_range(method: str, model: str) -> tuple[float, float]:
    """(lowest, highest) per-sequence cost the same fits gave on `model`'s hosts."""
    values = [h.over_seq_ms for h in of(method) if h.model == model]
    return min(values), max(values)


def correlation(method: str) -> float:
    """Across hosts: the engine's own cost against the host's decode step (does the cost follow the step?)."""
    x, y = ([h.decode_ms for h in of(method)], [h.own_ms[0] for h in of(method)])
    return statistics.correlation(x, y)


def values(method: str) -> str:
    """Every host's engine-own figure for a term's source: `lease option ms`, the Kimi miniature's first."""
    rows = sorted(of(method), key=lambda h: (not h.model.startswith("kimi"), h.lease, h.option))
    return ", ".join(f"{h.lease} {h.option} {_own(h)}" for h in rows)


def counts(method: str) -> str:
    rows = of(method)
    gpus = sorted({h.gpu for h in rows})
    per_gpu = f"all {gpus[0]}" if len(gpus) == 1 else \
        ", ".join(f"{len({h.lease for h in rows if h.gpu == g})} {g}" for g in gpus)
    return f"{len(rows)} fits over {len({h.lease for h in rows})} leases, {per_gpu}"


def _own(h: HostFit) -> str:
    low, high = (f"{x:.2f}" for x in h.own_ms)
    return low if low == high else f"{low}-{high}"


def summary(method: str) -> str:
    """One line per method for a term's source: every host's figure, ms and share of its decode step."""
    parts = [f"{h.lease} {h.gpu} {h.model} {h.option} {_own(h)} ms ({h.share:.2f} x its {h.decode_ms:.2f} ms "
             "decode step)" for h in of(method)]
    return "; ".join(parts)


def markdown(rows: tuple[HostFit, ...] | list[HostFit] = HOSTS) -> list[str]:
    lines = ["| lease | GPU | model | option | fixed ms/step | engine's own ms | per sequence ms | decode step ms | "
             "fixed / decode step | fit's error | runs | c | not separated |", "|---" * 13 + "|"]
    for h in rows:
        lines.append(f"| {h.lease} | {h.gpu} | {h.model} | {h.option} | {h.over_ms:.2f} | {_own(h)} | "
                     f"{h.over_seq_ms:.3f} | {h.decode_ms:.2f} | {h.share:.2f} | {100 * h.residual:.0f} % | "
                     f"{', '.join(h.runs)} | "
                     f"{'/'.join(map(str, h.levels))} | {', '.join(h.unseparated) or '-'} |")
    return lines


# ---------------------------------------------------------------- the offline measurement (opens the stores)

HBM_TBPS = {"H200": 4.8, "H100": 3.35}
READ_EFF = (4.3 / 4.8, 3.3 / 4.8)   # share of HBM peak a one-layer head and its LM head stream (box_terms._H200_EFF)


def head_read_ms(model: str, gpu: str, steps: int = 3) -> tuple[float, float]:
    """The EAGLE-3 head a lease served, read per step at TP 1: `steps` forwards of its layer and LM head, fc once."""
    from experiments.analysis.box_memory import Eagle3Head, drafter_groups
    head = Eagle3Head() if model.startswith("kimi") else Eagle3Head(   # experiments/eagle3/artifacts config.json
        hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, draft_vocab=4096)
    groups = {g.name: g.rank_bytes for g in drafter_groups(head, tp=1)}
    fc = groups.pop("draft fc (3 aux layers -> hidden)")
    groups.pop("draft embed_tokens")
    read = steps * sum(groups.values()) + fc
    return tuple(round(read / (HBM_TBPS[gpu] * e * 1e12) * 1e3, 3) for e in READ_EFF)  # type: ignore[return-value]


DRAFT_STEPS = 3   # the box's B and C, and the draft steps head_read_ms reads for


def _fit_one(lease, name: str, points: list, model: str, option: str, gpu: str) -> HostFit | None:
    """One option's fit over the lease's baselines and that option's runs alone (EAGLE-3: verification's growth
    folded into its own per-sequence and per-draft-step terms, no n-gram fit mixed in); the fixed cost of an
    EAGLE-3 step at DRAFT_STEPS: eagle_over_ms + DRAFT_STEPS x draft_ms."""
    from experiments.analysis.runs import run_config
    from experiments.analysis.speedup.stepcost import fit_profile, key_of
    by_id = {r.info.run_id: r for r in lease.runs}
    method = "ngram" if option == "A" else "eagle3"
    mine = [p for p in points if p.method == method and run_config(by_id[p.run_id]).option == option
            and p.excess_ms is not None]
    if not mine:
        return None
    pts = [p for p in points if p.method == "none"] + mine
    cap = run_config(by_id[mine[0].run_id]).graph_batch_limit
    cost = fit_profile(key_of(by_id[mine[0].run_id]), pts, cap, unit="ms").regimes.get("graphs")
    if cost is None or (cost.over_ms if method == "ngram" else cost.eagle_over_ms) is None:
        return None
    if method == "ngram":
        over, seq, unsep = cost.over_ms, cost.over_seq_ms, [u for u in cost.unseparated if u in ("over_seq", "b_tok")]
    else:
        over = cost.eagle_over_ms + DRAFT_STEPS * (cost.draft_ms or 0.0)
        seq, unsep = cost.eagle_over_seq_ms, [u for u in cost.unseparated if u in ("eagle_over_seq", "draft")]
    base = [p.base_step_ms for p in mine if p.c == 1] or [p.base_step_ms for p in mine]
    return HostFit(name, gpu, model, option, round(over, 3), round(seq or 0.0, 3), round(statistics.mean(base), 3),
                   (0.0, 0.0) if method == "ngram" else head_read_ms(model, gpu),
                   tuple(sorted({p.run_id[:8] for p in mine})), tuple(sorted({p.c for p in mine})), tuple(unsep),
                   round(cost.residual_rel, 3))


def measure(journal: Path) -> list[HostFit]:
    """Every SGLang lease's fits, per model and option (A, B, E), in the CUDA-graph regime."""
    from experiments.analysis.speedup.stepcost import key_of, level_steps
    from experiments.analysis.speedup.validate import leases
    out = []
    for lease in leases(journal):
        sglang = [r for r in lease.runs if key_of(r).engine == "sglang"]
        if lease.probe_only or not sglang:
            continue
        name = lease.folder.relative_to(journal).as_posix()
        gpu = "H100" if "h100" in name else "H200"
        points = [p for p in level_steps(lease.client, sglang, lease.name) if p.regime == "graphs"]
        models = {r.info.run_id: key_of(r).model for r in sglang}
        for model in sorted(set(models.values())):
            own = [p for p in points if models[p.run_id] == model]
            out += [f for option in ("A", "B", "E") if (f := _fit_one(lease, name, own, model, option, gpu))]
    return out


def source_lines(rows: list[HostFit]) -> list[str]:
    """HOSTS as this module holds it, to paste."""
    out = ["HOSTS: tuple[HostFit, ...] = ("]
    for h in rows:
        line = (f'HostFit("{h.lease}", "{h.gpu}", "{h.model}", "{h.option}", {h.over_ms}, {h.over_seq_ms}, '
                f'{h.decode_ms}, {h.head_read_ms}, {h.runs}, {h.levels}, {h.unseparated}, {h.residual}),')
        line = line.replace("'", '"')
        wrapped = textwrap.wrap(line, 114, break_on_hyphens=False, break_long_words=False)
        out += ["    " + wrapped[0], *("            " + w for w in wrapped[1:])]
    return [*out, ")"]


def main(argv: list[str] | None = None) -> int:
    from experiments.config.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.speedup.box_hosts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--journal", type=Path, default=ROOT / "docs" / "journal")
    a = ap.parse_args(argv)
    rows = measure(a.journal)
    print("\n".join(source_lines(rows)))
    print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
