"""The terms that decide the Blackwell box's speedup (Kimi-K2.5 INT4, SGLang TP 8, 8x RTX PRO 6000 over PCIe), each
with its source and, where the box never measured it, a low / mid / high range; the drafters' acceptance as ranges.
The step model that uses them: experiments/analysis/speedup/box.py.

A term without a source, or without a range where it is not a single measured figure, is refused (`Term`). The
engine's fixed overhead per speculative step ranges over every SGLang host measured (box_hosts.HOSTS).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from experiments.analysis.box_memory import Eagle3Head, drafter_groups
from experiments.analysis.speedup import box_hosts
from experiments.analysis.speedup.model import accept_length_for_rate
from experiments.config.kimi import KIMI

LEASE3 = "docs/journal/2026-12-02-h200/kimi_lease3/model_error_table.md"
KERNELS = "docs/journal/2026-12-02-h200/kimi_kernels.json"
REASONING = "docs/journal/2026-12-01-h200/runs.tar.xz"

# measured on the box (mission.md): single stream, decode-time shares, the throughput plateau
SINGLE_STREAM_TOK_S = 82.5
PLATEAU_TOK_S, PLATEAU_C = 1536.0, 128
SHARES = {"allreduce": 0.515, "attention": 0.153, "dense": 0.134, "moe": 0.111}
PLATEAU_TOLERANCE = 0.05   # a corner whose baseline at c = 128 is slower than the plateau by more is dropped

# Kimi-K2.5's shapes (conf/model/kimi_k25_int4.yaml) and the box (conf/site/blackwell.yaml)
HIDDEN, LAYERS, VOCAB, EXPERTS, TOP_K = KIMI.hidden, KIMI.layers, KIMI.vocab, KIMI.routed_experts, KIMI.top_k
GPUS = 8
ACTIVE_PARAMS = 32e9          # parameters a token passes through (Kimi-K2: 32 B activated)
ALLREDUCES_PER_LAYER = 2
DECODE_GRAPH_CAP = 128        # --cuda-graph-max-bs-decode of the baseline (conf/site/blackwell.yaml)
VERIFY_GRAPH_CAP = 32         # the same flag for speculative runs: verify graphs at 128 do not fit at 0.88

# HBM3e of the H200 the kernel table and the miniature ran on, and the box's GDDR7 (datasheets)
H200_TBPS, GDDR7_TBPS = 4.8, 1.792

# MoE kernel time per call at Kimi's TP-8 shard (N = 256, uniform routing) on one H200, least squares over the ten
# token counts of KERNELS: us = fixed + per_expert x distinct experts + per_token x tokens (tests hold them to it)
MOE_FIT = {"marlin_w4a16": (24.243, 1.0010, 0.23418), "triton_w4a16": (88.693, 6.5212, 0.0)}
TRITON_OVER_MARLIN_1 = 123.85 / 35.55   # Triton W4A16 / Marlin at one token (KERNELS): vLLM's MoE on the box


@dataclass(frozen=True)
class Term:
    """One input of the step model: a measured figure (low == mid == high) or a range with its middle."""
    name: str
    unit: str
    low: float
    mid: float
    high: float
    source: str
    short: str = ""            # the name the sensitivity table prints

    def __post_init__(self) -> None:
        values = (self.low, self.mid, self.high)
        if any(v is None or not math.isfinite(v) for v in values):
            raise ValueError(f"term {self.name}: no range (low/mid/high {values}); an unmeasured term needs one")
        if not self.low <= self.mid <= self.high:
            raise ValueError(f"term {self.name}: low <= mid <= high does not hold for {values}")
        if len(self.source.strip()) < 20:
            raise ValueError(f"term {self.name}: no source")

    @property
    def ranged(self) -> bool:
        return self.low < self.high

    def at(self, end: str) -> float:
        return {"low": self.low, "mid": self.mid, "high": self.high}[end]


def _h200_draft_ms(tbps: float, steps: int = 3) -> float:
    """What the miniature's EAGLE-3 head read per speculative step on the H200 at TP 1: `steps` forwards of its
    layer and LM head, its fc once; the fitted EAGLE-3 overhead holds this, the box's draft is priced apart."""
    groups = {g.name: g.rank_bytes for g in drafter_groups(Eagle3Head(), tp=1)}
    fc = groups.pop("draft fc (3 aux layers -> hidden)")
    groups.pop("draft embed_tokens")
    return (steps * sum(groups.values()) + fc) / (tbps * 1e12) * 1e3


_H200_EFF = (3.3, 3.8, 4.3)   # TB/s a one-layer head and its LM head stream on the H200 (69-90 % of 4.8)
_EAGLE_FIT = (3.53, 3.84, 4.15)   # E's and B's fitted EAGLE-3 overhead on the miniature, ms (LEASE3; box_hosts)
_EAGLE_OWN = tuple(fit - _h200_draft_ms(bw) for fit, bw in zip(_EAGLE_FIT, _H200_EFF, strict=True))
_NGRAM_MID = 2.34   # the miniature's NGRAM fit over both its leases: median of five leave-one-out fits (LEASE3)
_NGRAM_HOSTS, _EAGLE_HOSTS = box_hosts.overhead_range("ngram"), box_hosts.overhead_range("eagle3")
_ACROSS_HOSTS = ("; range: lowest to highest over the hosts seen (box_hosts.HOSTS: per-lease fits in ms, graphs "
                 "regime, from the journal's SGLang lease stores docs/journal/*/runs.tar.xz), not a bound: the box's "
                 "own CPU, and TP 8's eight ranks, never ran it, so its absolute ms there are unknown. Carried as ms, "
                 "not as a share of the step: the cost is the host's (scheduling and drafting exposed once "
                 "speculation turns off the overlap scheduler), and across the hosts it does not follow their 1.1-1.8 "
                 f"ms decode steps (correlation {box_hosts.correlation('ngram'):.2f} n-gram, "
                 f"{box_hosts.correlation('eagle3'):.2f} EAGLE-3; h200b's slowest step has the smallest n-gram cost); "
                 "as shares the box's 12.1 ms step would carry ")


def _as_share(method: str) -> str:
    """What the hosts' engine-own costs, as shares of their decode step, would be on the box's single stream."""
    shares = [h.own_ms[0] / h.decode_ms for h in box_hosts.of(method)]
    t1 = 1000.0 / SINGLE_STREAM_TOK_S
    return f"{min(shares) * t1:.1f}-{max(shares) * t1:.1f} ms ({min(shares):.2f}-{max(shares):.2f} x its {t1:.1f} ms)"


TERMS: dict[str, Term] = {t.name: t for t in (
    Term("bus_gbps", "GB/s", 20.0, 25.0, 41.0, short="bus",
         source="NCCL all_reduce_perf busbw on 8x RTX PRO 6000 over PCIe 5: 22.2 (dual Turin, default NCCL) to "
                "41.7 GB/s (switches, tuned) (voipmonitor/rtx6kpro hardware/pcie-bandwidth.md); mid: the profile's "
                "25; low 20 for the 1-8 MB messages of a decode step, below the sweeps' sizes"),
    Term("moe_fixed_share", "of MoE time at 1 token", 0.0, 0.52, 0.75, short="moe",
         source=f"{KERNELS} Marlin N=256 fit: the fixed 24.2 us are 0.75 of a one-token call on the H200 (high); "
                "mid: the per-expert and per-token part read at GDDR7's 1.79 instead of HBM3e's 4.8 TB/s (0.52); "
                "low: MoE time in proportion to the experts touched (weights read, no fixed cost)"),
    Term("attn_verify_growth", "per extra verified token", 0.1, 0.3, 1.0, short="attn",
         source="verify attention per sequence = decode attention x (1 + beta (q - 1)); SGLang 0.5.14 triton "
                "target-verify runs extend_attention_fwd (grid batch x heads x q/32 on SM120: each head reads its "
                "prefix once for up to 32 tokens, low 0.1) instead of the split-KV decode kernel; high 1.0: in "
                "proportion to tokens; mid: geometric mean"),
    Term("gemm_tflops", "TFLOPS per GPU", 120.0, 200.0, 300.0, short="flops",
         source="W4A16 GEMMs' effective throughput on SM120; RTX PRO 6000: ~500 TFLOPS dense BF16 (4,000 AI TOPS "
                "FP4 sparse / 8); mid: the profile's 200; ends: 25-60 % of it (assumption)"),
    Term("ngram_overhead_ms", "ms per step", _NGRAM_HOSTS[0], _NGRAM_MID, _NGRAM_HOSTS[1], short="host",
         source="SGLang NGRAM's fixed cost per speculative step (0.5.14), every SGLang host's own fit: "
                f"{box_hosts.values('ngram')} ms ({box_hosts.counts('ngram')}; the H100 lease ran no n-gram); mid: the "
                f"Kimi miniature over both its leases, {_NGRAM_MID} ({LEASE3}), the box's architecture, vocabulary and "
                f"flags" + _ACROSS_HOSTS + _as_share("ngram")),
    Term("ngram_overhead_seq_ms", "ms per sequence", 0.210, 0.224, 0.242, short="ovh/seq",
         source=f"the Kimi miniature's fits' cost per sequence in the batch, 0.210-0.242 ms ({LEASE3}); the "
                "SmolLM2 hosts' own fits ({:.2f}-{:.2f} ms, box_hosts) are not carried: c <= 16 there"
                .format(*box_hosts.seq_range("ngram", "smollm2_135m"))),
    Term("eagle3_overhead_ms", "ms per step", round(_EAGLE_HOSTS[0], 3), round(_EAGLE_OWN[1], 3),
         round(_EAGLE_HOSTS[1], 3), short="host",
         source="SGLang EAGLE-3's own fixed cost per speculative step, every SGLang host's fit less what its head "
                f"read there: {box_hosts.values('eagle3')} ms ({box_hosts.counts('eagle3')}). The Kimi miniature's "
                f"B 4.18 and E 3.56 ms (box_hosts; {LEASE3}: 4.15 and 3.53, each printed as the other's "
                "leave-one-out input) held "
                "its random full-vocabulary head's read (3 forwards, 11.4 GB at 3.3-4.3 TB/s: 2.65-3.46 ms); "
                "SmolLM2's head reads < 0.03 ms. The box's draft is priced from its own weights read. Mid: the "
                "miniature's, B and E averaged (3.84 less 3.00 at "
                "3.8 TB/s); range: lowest to highest over the hosts seen, carried as ms as ngram_overhead_ms (the "
                "box's own ms unknown); as shares the box's step would carry " + _as_share("eagle3")),
    Term("eagle3_overhead_seq_ms", "ms per sequence", 0.083, 0.108, 0.134, short="ovh/seq",
         source=f"the miniature's same fits per sequence: 0.083-0.094 (E), 0.123-0.134 (B) ms, lease 3 alone and "
                f"both leases ({LEASE3}); the SmolLM2 hosts' (" + "{:.2f}-{:.2f} ms, box_hosts: verification's "
                "growth folded in) are not carried".format(*box_hosts.seq_range("eagle3", "smollm2_135m"))),
    Term("vllm_overhead_ms", "ms per step", 0.0, round(_EAGLE_OWN[1], 3), round(_EAGLE_HOSTS[1], 3), short="host",
         source="vLLM 0.32's own cost per EAGLE-3 step on Kimi: never measured; low 0 (async scheduling, on for "
                "EAGLE in vLLM 0.32, hides it), mid/high: SGLang's"),
    Term("vllm_overhead_seq_ms", "ms per sequence", 0.0, 0.108, 0.134, short="ovh/seq",
         source="vLLM per sequence: never measured; low 0, mid/high: SGLang's"),
    Term("draft_tbps", "TB/s", 0.9, 1.25, 1.6, short="draft bw",
         source="what the draft's layer and LM head stream per forward on GDDR7: 1.79 TB/s peak (RTX PRO 6000 "
                "datasheet), 50-90 % of it (the H200 kernel table's Marlin streamed 52-69 % of its peak)"),
    Term("eager_ms_per_layer", "ms per layer per forward", 0.05, 0.17, 0.6, short="eager",
         source="a forward above the CUDA-graph cap launches eagerly: SmolLM2 on the H200 at c=16 eager took "
                "15.1-17.9 ms for 30 layers, all exposed (docs/journal/2026-11-30-h200/analysis.md), 0.6 (high); "
                "low 0.05: hidden behind the box's 40-80 ms GPU step but for syncs (assumption); mid: geometric mean"),
)}


@dataclass(frozen=True)
class Drafter:
    """An EAGLE-3 head: its published accept length at 3 steps / topk 1 / 4 draft tokens (low, mid, high) and
    the vocabulary of its LM head (low, high)."""
    key: str
    head: str
    accept: tuple[float, float, float] | None
    source: str
    vocab: tuple[int, int] = (VOCAB, VOCAB)


DRAFTERS: dict[str, Drafter] = {d.key: d for d in (
    Drafter("lightseek_k25", "lightseekorg/kimi-k2.5-eagle3", (2.687, 3.201, 3.342),
            "model card, SpecForge bench_eagle3: MT-Bench 2.69, GSM8K 3.20, HumanEval 3.29, MATH500 3.34, AIME 3.03 "
            "(conf/model/kimi_k25_int4.yaml; mid: the median); LM head over the full vocabulary (TorchSpec config)"),
    Drafter("aq_medai_k2", "AQ-MedAI/Kimi-K2-Instruct-eagle3", (3.165, 3.372, 3.490),
            "model card, measured on Kimi-K2 (not K2.5: an upper bound for the transfer): GSM8K 3.17, HumanEval "
            "3.37, Math500 3.49; its draft vocabulary unread: 32,000 (SpecForge's recipe) to 163,840",
            (32_000, VOCAB)),
    Drafter("aq_medai_k25", "AQ-MedAI/Kimi-K25-eagle3", None,
            "no published accept length (model card; sglang#19689)", (32_000, VOCAB)),
)}


class BandUnavailable(ValueError):
    """A band that needs an input nobody measured and nobody bounded; the message says which."""


def eagle_accept(drafter: Drafter, steps: int) -> tuple[float, float, float]:
    """Tokens per step at `steps` draft steps (topk 1): each published 3-step accept length read as an i.i.d.
    per-token acceptance and carried to `steps` (optimistic past 3: real acceptance falls with the position)."""
    if drafter.accept is None:
        raise BandUnavailable(f"{drafter.key} ({drafter.head}): {drafter.source}")
    return tuple(accept_length_for_rate(_rate(al, 3), steps) for al in drafter.accept)  # type: ignore[return-value]


def _rate(accept_length: float, steps: int) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accept_length_for_rate(mid, steps) < accept_length else (lo, mid)
    return (lo + hi) / 2


# n-gram on reasoning outputs: the workspace's reasoning prompts, SmolLM2-135M's greedy answers (160 tokens, first
# seen), the only reasoning-style outputs in the repo's run tarballs (REASONING: baseline ee8c30e6, A cd5d399d at 4
# draft tokens, 32 prompts at c=1 and 32 at c=8). SmolLM2 loops: 33 of its 64 answers repeat 10 % or more of their
# 6-grams, which Kimi-K2.5's long novel thinking chains do not; the 31 that do not are the Kimi proxy.
#   mid:  SGLang NGRAM's own tokens per step on those 31 (engine counters, spec_verify_ct): 1.533 at 4 draft tokens
#   low:  a replay of SGLang's NGRAM as one prompt-lookup chain per request (trie depth 18, num_draft_tokens - 1
#         drafted) over the same 31 baseline answers: 1.253 / 1.407 / 1.475 at 2 / 4 / 8 draft tokens (a lower
#         bound: SGLang's trie also sees other requests)
#   high: SGLang NGRAM over all 64 answers, loops included: 1.690 at 4 draft tokens
# 2 and 8 draft tokens: the chain replay times the same trie gains as at 4 (mid x1.090, high x1.201).
NGRAM_CHAIN = {2: 1.253, 4: 1.407, 8: 1.475}
NGRAM_TRIE_GAIN = (1.0, 1.533 / 1.407, 1.690 / 1.407)
NGRAM_SOURCE = (f"reasoning prompts' answers ({REASONING}) that do not loop: SGLang NGRAM chain replay (low), "
                "SGLang's own acceptance on them (mid), on all answers incl. SmolLM2's loops (high)")


def ngram_accept(k: int) -> tuple[float, float, float]:
    if k not in NGRAM_CHAIN:
        raise BandUnavailable(f"no n-gram acceptance replayed at {k} draft tokens (have {sorted(NGRAM_CHAIN)})")
    return tuple(min(float(k), NGRAM_CHAIN[k] * g) for g in NGRAM_TRIE_GAIN)  # type: ignore[return-value]


def draft_bytes_per_rank(vocab: int, tp: int = GPUS) -> tuple[float, float]:
    """(bytes one draft forward reads per rank: its layer and LM head; the fc read once per speculative step)."""
    groups = {g.name: g.rank_bytes for g in drafter_groups(Eagle3Head(draft_vocab=vocab), tp=tp)}
    fc = groups.pop("draft fc (3 aux layers -> hidden)")
    groups.pop("draft embed_tokens")
    return float(sum(groups.values())), float(fc)
