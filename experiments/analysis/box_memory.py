"""Per-GPU memory of the Blackwell box on day one: SGLang 0.5.14 serving Kimi-K2.5 INT4 at TP 8 with the
EAGLE-3 drafter, from the checkpoint's tensor shapes and how SGLang shards and sizes each part.

`python -m experiments.analysis.box_memory [--graph-mib-per-layer X --graph-bs 128 ...] [--json OUT]`

SGLang 0.5.14's sizing (model_executor/model_runner_kv_cache_mixin.py `_profile_available_bytes`):
    P  = free GPU memory before the weights load (capacity - CUDA context - NCCL)
    KV = (free after target + draft weights load) - (1 - f) * P  =  f * P - W
so whatever is left after the KV pool, (1 - f) * P, must hold the CUDA graphs, activations and everything
allocated later (the draft's KV beyond SGLang's allowance, the request table). Where each term comes from,
with its sources: docs/reference/box.md, "Day-one memory".
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from experiments.config.kimi import KIMI, KimiShapes

MIB = 1 << 20
GIB = 1 << 30
BF16 = 2
INT32 = 4


@dataclass(frozen=True)
class MoonViT:
    """The vision tower and projector (SGLang 0.5.14 configs/kimi_k25.py KimiK25VisionConfig defaults)."""
    layers: int = 27
    hidden: int = 1152
    mlp: int = 4304
    patch: int = 14
    pos_grid: int = 64
    merge: int = 2
    channels: int = 3


@dataclass(frozen=True)
class Eagle3Head:
    """lightseekorg/kimi-k2.5-eagle3: one LlamaForCausalLMEagle3 layer (TorchSpec's kimi_k25_eagle3.json)."""
    hidden: int = KIMI.hidden          # the target's (its fc projects the target's aux hidden states to it)
    heads: int = 64
    kv_heads: int = 64
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = KIMI.vocab            # the target's
    draft_vocab: int | None = None   # None: SGLang shares the target's lm_head (load_lm_head_from_target)
    aux_layers: int = 3
    layers: int = 1


@dataclass(frozen=True)
class TensorGroup:
    name: str
    checkpoint_bytes: int
    rank_bytes: int
    sharding: str
    freed_after_profile: bool = False   # counted when the KV pool is sized, released right after


def attention_groups(m: KimiShapes, tp: int) -> list[TensorGroup]:
    """MLA per layer (DeepseekV2AttentionMLA): q_a + kv_a fused and replicated, q_b/kv_b column, o row."""
    n = m.layers
    a_proj = (m.q_lora + m.kv_lora + m.rope) * m.hidden * BF16 * n
    q_b = m.heads * (m.nope + m.rope) * m.q_lora * BF16 * n
    kv_b = m.heads * (m.nope + m.v_head) * m.kv_lora * BF16 * n
    o = m.hidden * m.heads * m.v_head * BF16 * n
    norms = (m.q_lora + m.kv_lora + 2 * m.hidden) * BF16 * n
    return [
        TensorGroup("attn q_a_proj + kv_a_proj_with_mqa", a_proj, a_proj,
                    "replicated (fused_qkv_a_proj_with_mqa, ReplicatedLinear)"),
        TensorGroup("attn q_b_proj", q_b, q_b // tp, "column parallel over heads"),
        TensorGroup("attn kv_b_proj", kv_b, kv_b // tp, "column parallel over heads"),
        TensorGroup("attn w_kc + w_vc", 0, kv_b // tp, "per-rank copy of kv_b made by post_load_weights"),
        TensorGroup("attn o_proj", o, o // tp, "row parallel"),
        TensorGroup("norms (q_a, kv_a, input, post-attn)", norms, norms, "replicated"),
    ]


def moe_groups(m: KimiShapes, tp: int, kernel: str = "marlin") -> list[TensorGroup]:
    """Routed experts INT4 (compressed-tensors WNA16, FusedMoE TP: every rank holds all 384 experts, each
    cut along moe_intermediate), the shared expert (bf16, DeepseekV2MLP) and the router (replicated)."""
    n, e, h, i = m.layers - m.dense_layers, m.routed_experts, m.hidden, m.moe_intermediate
    weights = 3 * i * h                          # gate, up, down per expert
    packed = n * e * weights // 2                # 8 int4 per int32
    scales = n * e * weights // m.group_size * BF16
    shapes = n * e * 3 * 2 * 8                   # weight_shape: int64 (2,) per projection
    shared = n * 3 * i * m.shared_experts * h * BF16
    router = n * (e * h * BF16 + e * 4)          # gate.weight bf16 + e_score_correction_bias fp32
    groups = [
        TensorGroup("routed experts INT4 packed", packed, packed // tp, "MoE TP: intermediate dim / 8"),
        TensorGroup("routed experts bf16 group-32 scales", scales, scales // tp, "MoE TP: intermediate dim / 8"),
        TensorGroup("routed experts weight_shape", shapes, n * 2 * e * 2 * BF16, "replicated (E, 2) per w13/w2"),
        TensorGroup("shared expert", shared, shared // tp, "column (gate_up) / row (down) parallel"),
        TensorGroup("router gate + correction bias", router, router, "replicated"),
    ]
    if kernel == "triton":
        # CompressedTensorsWNA16TritonMoE never frees the g_idx / sort-index params that the Marlin path drops.
        g_idx = n * e * 2 * (h + i // tp) * INT32
        groups.append(TensorGroup("g_idx + sort indices (Triton WNA16)", 0, g_idx, "left allocated per rank"))
    return groups


def vit_params(v: MoonViT, text_hidden: int) -> tuple[int, int, int]:
    """(attention params, other tower params, projector params) of MoonViT-3D and its patch merger."""
    attn = v.layers * (3 * v.hidden * v.hidden + 3 * v.hidden + v.hidden * v.hidden + v.hidden)
    mlp = v.layers * (2 * v.hidden * v.mlp + v.mlp + v.hidden)
    norms = v.layers * 4 * v.hidden + 2 * v.hidden
    embed = v.channels * v.hidden * v.patch ** 2 + v.hidden + v.pos_grid ** 2 * v.hidden
    merged = v.hidden * v.merge ** 2
    projector = 2 * v.hidden + merged * merged + merged + merged * text_hidden + text_hidden
    return attn, mlp + norms + embed, projector


def dense_and_vocab_groups(m: KimiShapes, v: MoonViT, tp: int) -> list[TensorGroup]:
    """First-layer dense MLP, vocab-parallel embedding and lm_head, the final norm, the vision path."""
    dense = m.dense_layers * 3 * m.intermediate * m.hidden * BF16
    table = m.vocab * m.hidden * BF16
    attn, rest, projector = (p * BF16 for p in vit_params(v, m.hidden))
    return [
        TensorGroup("dense MLP (layer 0)", dense, dense // tp, "column (gate_up) / row (down) parallel"),
        TensorGroup("embed_tokens", table, table // tp, "vocab parallel"),
        TensorGroup("lm_head", table, table // tp, "vocab parallel (ParallelLMHead)"),
        TensorGroup("final norm", m.hidden * BF16, m.hidden * BF16, "replicated"),
        TensorGroup("vision attention (qkv, proj)", attn, attn // tp, "column / row parallel (VisionAttention)"),
        TensorGroup("vision MLP, norms, patch + pos embed", rest, rest, "replicated (nn.Linear, MLP2)"),
        TensorGroup("mm_projector", projector, projector, "replicated (ReplicatedLinear)"),
    ]


def target_groups(m: KimiShapes = KIMI, v: MoonViT = MoonViT(), tp: int = 8,
                  kernel: str = "marlin") -> list[TensorGroup]:
    return attention_groups(m, tp) + moe_groups(m, tp, kernel) + dense_and_vocab_groups(m, v, tp)


def drafter_groups(d: Eagle3Head = Eagle3Head(), tp: int = 8, target_hidden: int = KIMI.hidden) -> list[TensorGroup]:
    """The EAGLE-3 layer as SGLang's llama_eagle3.py builds it; its embed_tokens (and lm_head, when the
    config has no draft_vocab_size) are replaced by the target's after the KV pool is sized."""
    qkv = 2 * d.hidden * (d.heads + 2 * d.kv_heads) * d.head_dim * BF16 * d.layers
    o = d.hidden * d.heads * d.head_dim * BF16 * d.layers
    mlp = 3 * d.intermediate * d.hidden * BF16 * d.layers
    fc = d.aux_layers * target_hidden * d.hidden * BF16
    norms = (1 + 3 * d.layers) * d.hidden * BF16
    table = d.vocab * d.hidden * BF16
    head = (d.draft_vocab or d.vocab) * d.hidden * BF16
    return [
        TensorGroup("draft qkv_proj (2x hidden in)", qkv, qkv // tp, "column parallel (QKVParallelLinear)"),
        TensorGroup("draft o_proj", o, o // tp, "row parallel"),
        TensorGroup("draft MLP", mlp, mlp // tp, "column / row parallel"),
        TensorGroup("draft fc (3 aux layers -> hidden)", fc, fc, "replicated (torch.nn.Linear)"),
        TensorGroup("draft norms", norms, norms, "replicated"),
        TensorGroup("draft embed_tokens", 0, table // tp, "vocab parallel, then the target's", True),
        TensorGroup("draft lm_head", head, head // tp, "vocab parallel" + (", then the target's"
                    if d.draft_vocab is None else ""), d.draft_vocab is None),
    ]


def kv_bytes_per_token(m: KimiShapes = KIMI, dtype_bytes: int = BF16) -> int:
    """MLA latent + rope key per layer; not divided by TP: every rank caches every token's latent."""
    return (m.kv_lora + m.rope) * m.layers * dtype_bytes


def draft_kv_bytes_per_token(d: Eagle3Head = Eagle3Head(), tp: int = 8, dtype_bytes: int = BF16) -> int:
    """The drafter's MHA KV per rank: K and V of its own kv heads / TP."""
    return max(1, d.kv_heads // tp) * d.head_dim * 2 * d.layers * dtype_bytes


@dataclass(frozen=True)
class BoxInputs:
    capacity_mib: float = 97887.0          # nvidia-smi memory.total, what SGLang reads as the card's memory
    runtime_before_load_mib: float = 2048.0  # CUDA context + NCCL before the weights (read the box's log)
    mem_fraction_static: float = 0.88
    tp: int = 8
    speculative: bool = True
    moe_kernel: str = "marlin"             # SGLang's default; "triton" with the sm12x_wna16_moe_triton patch
    kv_dtype_bytes: int = BF16
    graph_mib_per_layer: float | None = None   # measured on the miniature; None leaves the term open
    graph_mib_fixed: float = 0.0
    graph_bs: int = 128                    # the largest graph batch the per-layer figure was measured at
    box_graph_bs: int = 128                # --cuda-graph-max-bs-decode on the box
    graph_tp_scale: float = 1.0            # per-rank share at TP 8 of a TP-1 layer's graph memory (1: bound)
    chunked_prefill_size: int = 8192       # SGLang's default for a 90-160 GiB card
    max_running_requests: int = 128
    context_len: int = 32768
    margin_mib: float = 2048.0             # allocator fragmentation, cuBLAS/NCCL workspaces grown later


def graph_bytes(inp: BoxInputs, m: KimiShapes = KIMI) -> int | None:
    """fixed + per layer x m.layers (Kimi: 61) x TP share x (box batch / measured batch)."""
    if inp.graph_mib_per_layer is None:
        return None
    per_layer = inp.graph_mib_per_layer * inp.graph_tp_scale * inp.box_graph_bs / inp.graph_bs
    return int((inp.graph_mib_fixed + per_layer * m.layers) * MIB)


def prefill_activation_bytes(m: KimiShapes, tp: int, tokens: int) -> int:
    """Peak of one prefill chunk: the Triton fused MoE's three intermediate caches (tokens x top-k x
    2I/tp, I/tp and hidden), four hidden-size buffers, and q/k/v of the MHA prefill path."""
    moe = tokens * m.top_k * (3 * m.moe_intermediate // tp + m.hidden) * BF16
    hidden = 4 * tokens * m.hidden * BF16
    attn = tokens * (m.heads // tp) * (2 * (m.nope + m.rope) + m.v_head) * BF16
    return moe + hidden + attn


@dataclass
class MemoryPlan:
    pre_load_bytes: int
    target_rank_bytes: int
    draft_rank_bytes: int
    freed_after_profile_bytes: int
    kv_budget_bytes: int
    kv_cell_bytes: int
    kv_tokens: int
    headroom_bytes: int
    graph_bytes: int | None
    activation_bytes: int
    draft_kv_excess_bytes: int
    req_to_token_bytes: int
    margin_bytes: int
    fits: bool | None
    graph_room_bytes: int
    recommended_fraction: float
    checkpoint_bytes: int


def _draft_terms(inp: BoxInputs, m: KimiShapes, head: Eagle3Head) -> tuple[int, int]:
    """(KV cell per token with SGLang's draft allowance, draft KV bytes per token beyond that allowance).
    SGLang scales the target cell by 1 + draft_layers / layers, assuming the draft's KV is MLA-sized."""
    plain = kv_bytes_per_token(m, inp.kv_dtype_bytes)
    if not inp.speculative:
        return plain, 0
    cell = int(plain * (1 + head.layers / m.layers))
    return cell, max(0, draft_kv_bytes_per_token(head, inp.tp, inp.kv_dtype_bytes) - (cell - plain))


def _fraction_that_fits(p: int, weights: int, freed: int, fixed_needs: int, cell: int, excess: int) -> float:
    """Largest f with (1 - f) P + freed >= fixed + excess * (f P - W) / cell, rounded down to 0.005."""
    x = excess / cell
    f = (p + freed - fixed_needs + x * weights) / (p * (1 + x))
    return math.floor(f * 200) / 200


def plan(inp: BoxInputs = BoxInputs(), m: KimiShapes = KIMI, v: MoonViT = MoonViT(),
         head: Eagle3Head = Eagle3Head()) -> MemoryPlan:
    target = target_groups(m, v, inp.tp, inp.moe_kernel)
    draft = drafter_groups(head, inp.tp, m.hidden) if inp.speculative else []
    p = int((inp.capacity_mib - inp.runtime_before_load_mib) * MIB)
    weights = sum(g.rank_bytes for g in target + draft)
    freed = sum(g.rank_bytes for g in draft if g.freed_after_profile)
    f = inp.mem_fraction_static
    kv_budget = int(f * p) - weights
    cell, excess = _draft_terms(inp, m, head)
    tokens = max(0, kv_budget // cell)
    graphs = graph_bytes(inp, m)
    activations = prefill_activation_bytes(m, inp.tp, inp.chunked_prefill_size)
    req_to_token = inp.max_running_requests * inp.context_len * INT32
    fixed = activations + req_to_token + int(inp.margin_mib * MIB)
    headroom = p - int(f * p) + freed
    needs = fixed + excess * tokens + (graphs or 0)
    return MemoryPlan(
        pre_load_bytes=p, target_rank_bytes=sum(g.rank_bytes for g in target),
        draft_rank_bytes=sum(g.rank_bytes for g in draft), freed_after_profile_bytes=freed,
        kv_budget_bytes=kv_budget, kv_cell_bytes=cell, kv_tokens=tokens, headroom_bytes=headroom,
        graph_bytes=graphs, activation_bytes=activations, draft_kv_excess_bytes=excess * tokens,
        req_to_token_bytes=req_to_token, margin_bytes=int(inp.margin_mib * MIB),
        fits=None if graphs is None else (kv_budget > 0 and headroom >= needs),
        graph_room_bytes=headroom - (needs - (graphs or 0)),
        recommended_fraction=_fraction_that_fits(p, weights, freed, fixed + (graphs or 0), cell, excess),
        checkpoint_bytes=sum(g.checkpoint_bytes for g in target))


def startup_timeout_s(mini_load_s: float, mini_jit_s: float, mini_graph_s: float, mini_layers: int, *,
                      disk_gb_per_s: float, checkpoint_reads: int = 1, box_layers: int = KIMI.layers,
                      graph_batch_ratio: float = 1.0, fixed_s: float = 60.0, safety: float = 1.5) -> float:
    """timeout = safety x (fixed + load + JIT + graphs) on the box, from the miniature's measured phases:
    load   = mini_load x (box rank bytes / miniature bytes)  +  reads x checkpoint bytes / disk bandwidth
             (the miniature loads dummy weights: its load phase is init + INT4 repack, which scales with the
             bytes a rank holds; the box also reads the checkpoint, every rank all of it, once from disk
             when the page cache holds 595 GB, else `checkpoint_reads` times)
    JIT    = mini_jit (kernels compile per shape, not per layer)
    graphs = mini_graph x box_layers / mini_layers x graph_batch_ratio (captured batch sizes, box / mini)"""
    box = sum(g.rank_bytes for g in target_groups(KIMI, tp=8))
    mini = sum(g.rank_bytes for g in target_groups(replace(KIMI, layers=mini_layers), tp=1))
    ckpt = sum(g.checkpoint_bytes for g in target_groups(KIMI, tp=8))
    load = mini_load_s * box / mini + checkpoint_reads * ckpt / (disk_gb_per_s * 1e9)
    graphs = mini_graph_s * box_layers / mini_layers * graph_batch_ratio
    return safety * (fixed_s + load + mini_jit_s + graphs)


def graph_sensitivity(inp: BoxInputs, graph_gib: tuple[float, ...] = (0, 2, 4, 6, 8, 10, 12, 16)
                      ) -> list[tuple[float, float, int]]:
    """(graph GiB per rank, largest fraction that fits, KV tokens at that fraction) for assumed graph sizes."""
    rows = []
    for g in graph_gib:
        assumed = replace(inp, graph_mib_per_layer=0.0, graph_mib_fixed=g * 1024)
        f = plan(assumed).recommended_fraction
        rows.append((g, f, plan(replace(assumed, mem_fraction_static=f)).kv_tokens))
    return rows


def _gb(n: int | None) -> str:
    return "open" if n is None else f"{n / GIB:.2f}"


def render(inp: BoxInputs, p: MemoryPlan, m: KimiShapes = KIMI) -> str:
    rows = ["| tensor group | SGLang 0.5.14 sharding at TP 8 | checkpoint GB | per rank GiB |", "|---|---|---|---|"]
    groups = target_groups(m, tp=inp.tp, kernel=inp.moe_kernel)
    groups += drafter_groups(tp=inp.tp) if inp.speculative else []
    rows += [f"| {g.name} | {g.sharding} | {g.checkpoint_bytes / 1e9:.2f} | {g.rank_bytes / GIB:.3f} |"
             for g in groups]
    verdict = {True: "fits", False: "does NOT fit", None: "open (graph memory not measured yet)"}[p.fits]
    lines = [
        f"| **target total** | | **{p.checkpoint_bytes / 1e9:.2f}** | **{p.target_rank_bytes / GIB:.2f}** |",
        f"| **draft total (at KV sizing)** | | | **{p.draft_rank_bytes / GIB:.2f}** |", "",
        f"free before load P = {_gb(p.pre_load_bytes)} GiB (capacity {inp.capacity_mib:.0f} MiB - "
        f"{inp.runtime_before_load_mib:.0f} MiB runtime)",
        f"KV pool at f = {inp.mem_fraction_static}: f*P - W = {_gb(p.kv_budget_bytes)} GiB = {p.kv_tokens:,} "
        f"tokens ({p.kv_cell_bytes:,} B/token/rank incl. the draft allowance)",
        f"left after the KV pool: (1-f)*P + freed draft tables = {_gb(p.headroom_bytes)} GiB; it must hold "
        f"graphs {_gb(p.graph_bytes)} + prefill activations {_gb(p.activation_bytes)} + draft KV beyond "
        f"SGLang's allowance {_gb(p.draft_kv_excess_bytes)} + request table {_gb(p.req_to_token_bytes)} + "
        f"margin {_gb(p.margin_bytes)} GiB",
        f"room left for CUDA graphs at f = {inp.mem_fraction_static}: {_gb(p.graph_room_bytes)} GiB",
        f"verdict for --mem-fraction-static {inp.mem_fraction_static}: {verdict}",
        f"largest fraction that fits: {p.recommended_fraction:.3f}"
        + ("" if p.graph_bytes is not None else " (graphs counted as 0: an upper bound)"),
    ]
    if p.graph_bytes is None:
        lines += ["", "| CUDA graphs GiB/rank (assumed) | largest fraction | KV tokens there |", "|---|---|---|"]
        lines += [f"| {g:g} | {f:.3f} | {t:,} |" for g, f, t in graph_sensitivity(inp)]
    return "\n".join(rows + lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.box_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BoxInputs()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif name == "moe_kernel":
            ap.add_argument(flag, choices=["triton", "marlin"], default=value)
        else:
            numeric = float if isinstance(value, float) or name == "graph_mib_per_layer" else int
            ap.add_argument(flag, type=numeric, default=value)
    ap.add_argument("--json", type=Path, default=None, help="also write inputs, groups and plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> MemoryPlan:
    args = vars(parser().parse_args(argv))
    out = args.pop("json")
    inp = BoxInputs(**args)
    result = plan(inp)
    print(render(inp, result))
    if out is not None:
        groups = target_groups(tp=inp.tp, kernel=inp.moe_kernel) + (drafter_groups(tp=inp.tp) if inp.speculative
                                                                    else [])
        out.write_text(json.dumps({"inputs": asdict(inp), "groups": [asdict(g) for g in groups],
                                   "plan": asdict(result)}, indent=2))
    return result


if __name__ == "__main__":
    main()
