"""The box's day-one memory: tensor totals against the published checkpoint, SGLang's sharding and KV sizing
rules, the fraction rule, the startup-timeout formula and the CLI."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from experiments.analysis.box_memory import (
    GIB,
    MIB,
    BoxInputs,
    Eagle3Head,
    draft_kv_bytes_per_token,
    drafter_groups,
    graph_bytes,
    kv_bytes_per_token,
    main,
    plan,
    startup_timeout_s,
    target_groups,
)
from experiments.config.kimi import KIMI

PUBLISHED_CHECKPOINT_BYTES = 595e9   # moonshotai/Kimi-K2.5, "595GB"


def by_name(groups):
    return {g.name: g for g in groups}


def test_checkpoint_total_matches_the_published_size() -> None:
    total = sum(g.checkpoint_bytes for g in target_groups())
    assert abs(total - PUBLISHED_CHECKPOINT_BYTES) / PUBLISHED_CHECKPOINT_BYTES < 0.005


def test_routed_experts_split_eight_ways_and_replicated_parts_do_not() -> None:
    groups = by_name(target_groups(tp=8))
    packed = groups["routed experts INT4 packed"]
    assert packed.rank_bytes * 8 == packed.checkpoint_bytes
    # 60 MoE layers x 384 experts x (gate, up, down: 2048 x 7168) x half a byte
    assert packed.checkpoint_bytes == 60 * 384 * 3 * 2048 * 7168 // 2
    for name in ("attn q_a_proj + kv_a_proj_with_mqa", "router gate + correction bias", "mm_projector"):
        assert groups[name].rank_bytes == groups[name].checkpoint_bytes
    per_rank = sum(g.rank_bytes for g in groups.values())
    assert per_rank > sum(g.checkpoint_bytes for g in groups.values()) / 8   # replication costs more than 1/8


def test_marlin_path_frees_what_the_triton_path_keeps() -> None:
    triton = by_name(target_groups(kernel="triton"))
    marlin = by_name(target_groups(kernel="marlin"))
    assert "g_idx + sort indices (Triton WNA16)" in triton and "g_idx + sort indices (Triton WNA16)" not in marlin
    # (E, hidden) and (E, I/tp) int32, twice each, over 60 layers
    assert triton["g_idx + sort indices (Triton WNA16)"].rank_bytes == 60 * 384 * 2 * (7168 + 256) * 4


def test_mla_kv_is_replicated_across_ranks() -> None:
    assert kv_bytes_per_token() == (512 + 64) * 61 * 2 == 70_272
    one_rank = plan(BoxInputs(tp=1, speculative=False))
    eight = plan(BoxInputs(tp=8, speculative=False))
    assert one_rank.kv_cell_bytes == eight.kv_cell_bytes == 70_272
    assert draft_kv_bytes_per_token(Eagle3Head(), tp=8) == 8 * 128 * 2 * 2


def test_kv_pool_follows_sglang_profile_formula() -> None:
    inp = BoxInputs(graph_mib_per_layer=50.0)
    p = plan(inp)
    weights = p.target_rank_bytes + p.draft_rank_bytes
    assert p.kv_budget_bytes == int(inp.mem_fraction_static * p.pre_load_bytes) - weights
    assert p.kv_tokens * p.kv_cell_bytes <= p.kv_budget_bytes < (p.kv_tokens + 1) * p.kv_cell_bytes
    assert p.kv_cell_bytes == int(70_272 * (1 + 1 / 61))   # SGLang's draft allowance for one draft layer
    # a higher fraction gives more KV and less room for everything else
    q = plan(replace(inp, mem_fraction_static=0.9))
    assert q.kv_tokens > p.kv_tokens and q.headroom_bytes < p.headroom_bytes


def test_recommended_fraction_is_the_edge_of_fitting() -> None:
    inp = BoxInputs(graph_mib_per_layer=80.0)
    f = plan(inp).recommended_fraction
    assert plan(replace(inp, mem_fraction_static=f)).fits is True
    assert plan(replace(inp, mem_fraction_static=round(f + 0.01, 3))).fits is False


def test_graph_term_open_until_measured_and_scaled_to_the_box() -> None:
    assert plan(BoxInputs()).fits is None
    assert graph_bytes(BoxInputs()) is None
    measured = BoxInputs(graph_mib_per_layer=10.0, graph_bs=64, box_graph_bs=128, graph_tp_scale=0.5,
                         graph_mib_fixed=100.0)
    assert graph_bytes(measured) == int((100.0 + 10.0 * 0.5 * 2 * 61) * MIB)
    assert plan(BoxInputs(graph_mib_per_layer=400.0)).fits is False   # 24 GiB of graphs cannot fit


def test_drafter_tables_are_shared_unless_it_has_its_own_vocabulary() -> None:
    shared = by_name(drafter_groups(Eagle3Head()))
    assert shared["draft embed_tokens"].freed_after_profile and shared["draft lm_head"].freed_after_profile
    own = by_name(drafter_groups(Eagle3Head(draft_vocab=32000)))
    assert not own["draft lm_head"].freed_after_profile
    assert own["draft lm_head"].rank_bytes == 32000 * 7168 * 2 // 8
    assert shared["draft fc (3 aux layers -> hidden)"].rank_bytes == 3 * 7168 * 7168 * 2


def test_startup_timeout_formula() -> None:
    ckpt = sum(g.checkpoint_bytes for g in target_groups())
    only_disk = startup_timeout_s(0.0, 0.0, 0.0, 4, disk_gb_per_s=2.0, fixed_s=0.0, safety=1.0)
    assert only_disk == pytest.approx(ckpt / 2e9)
    base = dict(disk_gb_per_s=1e9, fixed_s=0.0, safety=1.0)
    graphs = startup_timeout_s(0.0, 0.0, 10.0, 4, **base) - startup_timeout_s(0.0, 0.0, 0.0, 4, **base)
    assert graphs == pytest.approx(10.0 * 61 / 4, rel=1e-6)
    jit = startup_timeout_s(0.0, 30.0, 0.0, 4, **base) - startup_timeout_s(0.0, 0.0, 0.0, 4, **base)
    assert jit == pytest.approx(30.0, rel=1e-6)
    mini = sum(g.rank_bytes for g in target_groups(replace(KIMI, layers=4), tp=1))
    box = sum(g.rank_bytes for g in target_groups(tp=8))
    load = startup_timeout_s(20.0, 0.0, 0.0, 4, **base) - startup_timeout_s(0.0, 0.0, 0.0, 4, **base)
    assert load == pytest.approx(20.0 * box / mini, rel=1e-6)


def test_cli_writes_plan_and_groups(tmp_path, capsys) -> None:
    out = tmp_path / "box.json"
    result = main(["--graph-mib-per-layer", "60", "--graph-bs", "128", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "verdict for --mem-fraction-static 0.88" in printed
    data = json.loads(out.read_text())
    assert data["inputs"]["graph_mib_per_layer"] == 60.0
    assert data["plan"]["kv_tokens"] == result.kv_tokens > 0
    assert result.target_rank_bytes / GIB == pytest.approx(sum(g["rank_bytes"] for g in data["groups"]
                                                              if not g["name"].startswith("draft")) / GIB)


def test_the_box_site_waits_for_the_start_the_miniature_predicts() -> None:
    """The H200 miniature's measured phases (docs/journal/2026-12-02-h200/kimi_served): load 0.41 s, JIT 103 s,
    graphs 15.2 s at 4 layers with 12 decode sizes against the box's 20; the box site must wait that long even
    from a 1 GB/s disk, and the workspace default stays short for small models."""
    from conftest import compose_cfg
    needed = startup_timeout_s(0.41, 103.0, 15.2, 4, disk_gb_per_s=1.0, graph_batch_ratio=20 / 12)
    assert compose_cfg("site=blackwell", "+option=B").server.startup_timeout_s >= needed > 900
    assert compose_cfg("+option=A").server.startup_timeout_s == 900
