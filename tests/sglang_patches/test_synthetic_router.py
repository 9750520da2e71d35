"""The synthetic router against SGLang's own Kimi-K2 top-k (compiled from SGLang 0.5.14's source when the overlay
is there, else the installed SGLang's: its topk module does not import on a CPU-only machine), on router logits
and a correction bias made the way SGLang's dummy loader makes them."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

from experiments.config.kimi import KIMI
from experiments.config.paths import ROOT, cache_dir
from sglang_patches import Context, PatchRefused, Targets, moe_budget, synthetic_router
from sglang_patches.moe_budget import MODEL_FORWARD, SELECT_EXPERTS

EXPERTS, TOP_K, HIDDEN = KIMI.routed_experts, KIMI.top_k, KIMI.hidden


def uniform_expectation(tokens: int) -> float:
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)


@pytest.fixture(scope="module")
def kimi_topk():
    """SGLang's torch routing for one expert group (Kimi-K2: sigmoid + correction bias, top-8, renormalised)."""
    overlay = cache_dir() / "sglang-0.5.14" / "sglang" / "srt" / "layers" / "moe" / "topk.py"
    if not overlay.exists():
        spec = importlib.util.find_spec("sglang")
        if spec is None:
            pytest.skip("no SGLang source")
        overlay = Path(spec.submodule_search_locations[0], "srt", "layers", "moe", "topk.py")
    tree = ast.parse(overlay.read_text())
    body = [n for n in tree.body if getattr(n, "name", None) == "kimi_k2_biased_topk_impl"]
    assert len(body) == 1
    body[0].decorator_list = []   # SGLang wraps it in torch.compile: the plain function is the code
    ns: dict = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(overlay), "exec"), ns)
    return ns["kimi_k2_biased_topk_impl"]


class TopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


def dummy_router(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits and correction bias as under `--load-format dummy` (every weight ~U(-1e-3, 1e-3), seed 1234):
    the gate sees RMS-normalised hidden states times the norm's weight."""
    def dummy(*shape: int) -> torch.Tensor:
        return torch.empty(*shape).uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1234))
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True)) * dummy(HIDDEN)
    return normed @ dummy(EXPERTS, HIDDEN).T, dummy(EXPERTS)


def stand_in(kimi_topk, bias: torch.Tensor):
    """A module with SGLang's select_experts signature over SGLang's top-k, and a model forward, as targets."""
    module = types.ModuleType("topk_stand")

    def select_experts(hidden_states, router_logits, topk_config, *, layer_id=None, num_token_non_padded=None,
                       expert_location_dispatch_info=None):
        w, ids = kimi_topk(hidden_states, router_logits, topk_config.correction_bias, TOP_K, True)
        return TopKOutput(w, ids, router_logits)

    module.select_experts = select_experts
    config = types.SimpleNamespace(correction_bias=bias, scoring_func="sigmoid")

    class Model:
        def forward(self, input_ids, positions, forward_batch):
            return module.select_experts(hidden_states=input_ids, router_logits=forward_batch.logits,
                                         topk_config=config)

    resolved = {SELECT_EXPERTS: (module, "select_experts", module.select_experts),
                MODEL_FORWARD: (Model, "forward", Model.forward)}
    return module, Model, config, resolved


def routed(module, config, logits: torch.Tensor) -> TopKOutput:
    return module.select_experts(torch.zeros(logits.shape[0], 1), logits, config)


def with_skew(monkeypatch, kimi_topk, bias, skew: str):
    monkeypatch.setenv(synthetic_router.SKEW_ENV, skew)
    module, model, config, resolved = stand_in(kimi_topk, bias)
    synthetic_router.PATCH.apply(Targets({SELECT_EXPERTS: resolved[SELECT_EXPERTS]}))
    return module, model, config, resolved


def mean_distinct(module, config, tokens: int, draws: int = 6) -> float:
    counts = [routed(module, config, dummy_router(tokens, seed)[0]).topk_ids.unique().numel()
              for seed in range(draws)]
    return sum(counts) / draws


def test_dummy_weights_route_every_token_to_the_same_experts(kimi_topk):
    logits, bias = dummy_router(512, 0)
    module, _, config, _ = stand_in(kimi_topk, bias)
    ids = routed(module, config, logits).topk_ids
    assert logits.abs().max() < 5e-4 and logits.std() < 5e-5
    # 512 tokens touch a handful of experts (8 plus those whose bias is within a logit's reach of the 8th),
    # all among the top of the correction bias: the bias decides, the tokens barely do
    assert ids.unique().numel() <= 3 * TOP_K
    assert set(ids.unique().tolist()) <= set(bias.topk(4 * TOP_K).indices.tolist())


@pytest.mark.parametrize("tokens", [8, 64, 512])
def test_zero_skew_is_near_uniform(kimi_topk, monkeypatch, tokens):
    module, _, config, _ = with_skew(monkeypatch, kimi_topk, dummy_router(1, 0)[1], "0")
    assert routed(module, config, dummy_router(1, 0)[0]).topk_ids.unique().numel() == TOP_K
    got, expected = mean_distinct(module, config, tokens), uniform_expectation(tokens)
    assert abs(got - expected) <= 0.05 * expected + 2, (got, expected)


def test_skew_concentrates_routing_on_popular_experts(kimi_topk, monkeypatch):
    bias = dummy_router(1, 0)[1]
    uniform = mean_distinct(with_skew(monkeypatch, kimi_topk, bias, "0")[0], stand_in(kimi_topk, bias)[2], 64)
    module, _, config, _ = with_skew(monkeypatch, kimi_topk, bias, "0.5")
    skewed = mean_distinct(module, config, 64)
    assert skewed < 0.8 * uniform
    ids = routed(module, config, dummy_router(4096, 7)[0]).topk_ids
    load = torch.bincount(ids.flatten(), minlength=EXPERTS).float()
    popular = synthetic_router.popularity_bias(EXPERTS, 1.0).topk(EXPERTS // 10).indices
    assert load[popular].sum() / load.sum() > 0.3   # top 10 % of experts by bias take > 30 % of the slots


def test_routing_is_deterministic_and_the_bias_the_same_in_another_process(kimi_topk, monkeypatch):
    logits, bias = dummy_router(64, 3)
    module, _, config, _ = with_skew(monkeypatch, kimi_topk, bias, "0.25")
    first, again = routed(module, config, logits), routed(module, config, logits.clone())
    assert torch.equal(first.topk_ids, again.topk_ids) and torch.equal(first.topk_weights, again.topk_weights)
    code = ("from sglang_patches.synthetic_router import popularity_bias; "
            f"print(repr(popularity_bias({EXPERTS}, 0.25).tolist()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert ast.literal_eval(out.stdout) == synthetic_router.popularity_bias(EXPERTS, 0.25).tolist()
    z = synthetic_router.popularity_bias(EXPERTS, 1.0)
    assert abs(float(z.mean())) < 1e-6 and abs(float(z.std()) - 1.0) < 0.02   # standard-normal quantiles
    assert sorted(synthetic_router.popularity_bias(EXPERTS, 1.0).argsort().tolist()) == list(range(EXPERTS))


def test_budget_after_the_synthetic_router_caps_the_verify_step(kimi_topk, monkeypatch):
    verify = types.SimpleNamespace(is_target_verify=lambda: True)
    decode = types.SimpleNamespace(is_target_verify=lambda: False)
    logits, bias = dummy_router(64, 5)
    monkeypatch.setenv(moe_budget.BUDGET_ENV, "32")
    module, model_cls, config, resolved = with_skew(monkeypatch, kimi_topk, bias, "0")
    moe_budget.PATCH.apply(Targets(dict(resolved)))
    model = model_cls()

    def run(mode):
        return model.forward(torch.zeros(64, 1), None, types.SimpleNamespace(forward_mode=mode, logits=logits))

    unbudgeted, budgeted = run(decode).topk_ids, run(verify).topk_ids
    assert unbudgeted.unique().numel() > 150 and budgeted.unique().numel() <= 32


def test_the_budget_re_routes_by_the_logits_the_top_k_ran_on(kimi_topk, monkeypatch):
    """Behind the synthetic router, substitutes for dropped experts are chosen by the synthetic logits (those in
    the top-k output), not by the degenerate dummy logits that select_experts was called with."""
    verify = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_target_verify=lambda: True))
    logits, bias = dummy_router(64, 7)
    monkeypatch.setenv(moe_budget.BUDGET_ENV, "32")
    module, _, config, resolved = with_skew(monkeypatch, kimi_topk, bias, "0")
    unbudgeted = routed(module, config, logits)
    moe_budget.PATCH.apply(Targets(dict(resolved)))
    monkeypatch.setattr(moe_budget, "current_forward_batch", lambda: verify)
    budgeted = routed(module, config, logits)
    expected = moe_budget.budget_topk(unbudgeted.topk_weights, unbudgeted.topk_ids, unbudgeted.router_logits, 32,
                                      correction_bias=bias)
    assert torch.equal(budgeted.topk_ids, expected[1])
    assert not torch.equal(unbudgeted.router_logits, logits)   # the router did replace them


def test_the_synthetic_router_refuses_to_go_after_the_budget(kimi_topk, monkeypatch):
    monkeypatch.setenv(moe_budget.BUDGET_ENV, "32")
    monkeypatch.setenv(synthetic_router.SKEW_ENV, "0")
    _, _, _, resolved = stand_in(kimi_topk, dummy_router(1, 0)[1])
    moe_budget.PATCH.apply(Targets(dict(resolved)))
    with pytest.raises(PatchRefused, match="synthetic_router: apply it before moe_budget"):
        synthetic_router.PATCH.apply(Targets({SELECT_EXPERTS: resolved[SELECT_EXPERTS]}))


@pytest.mark.parametrize("raw", [None, "", "abc", "-0.5", "nan", "inf", "11"])
def test_bad_skew_values_are_refused(monkeypatch, raw):
    if raw is None:
        monkeypatch.delenv(synthetic_router.SKEW_ENV, raising=False)
    else:
        monkeypatch.setenv(synthetic_router.SKEW_ENV, raw)
    with pytest.raises(PatchRefused, match=synthetic_router.SKEW_ENV):
        synthetic_router.PATCH.apply(Targets({}))


def test_active_only_for_moe_models():
    when = synthetic_router.PATCH.when
    assert when.skip_reason(Context(model_type="kimi_k25")) is None
    assert when.skip_reason(Context(model_type="deepseek_v3")) is None
    assert "llama" in when.skip_reason(Context(model_type="llama"))


@pytest.mark.gpu
def test_the_transform_is_captured_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits = torch.randn(16, EXPERTS, device="cuda", dtype=torch.bfloat16) * 3e-5
    cache = synthetic_router.BiasCache(0.5)
    eager = synthetic_router.synthetic_logits(logits, cache(logits))
    graph, static_in = torch.cuda.CUDAGraph(), logits.clone()
    fresh = synthetic_router.BiasCache(0.5)   # built inside the capture: must not be cached there
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = synthetic_router.synthetic_logits(static_in, fresh(static_in))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(static_out, eager) and not fresh._cache


def test_popularity_stats_say_what_the_skew_means():
    uniform = synthetic_router.popularity_stats(0.0, samples=40_000)
    assert abs(uniform["top10_share"] - 0.10) < 0.01 and uniform["max_over_mean"] < 1.2
    assert abs(uniform["distinct"][64] - uniform_expectation(64)) < 3
    skewed = synthetic_router.popularity_stats(0.5, samples=40_000)
    assert 0.35 < skewed["top10_share"] < 0.45 and skewed["distinct"][64] < 0.8 * uniform["distinct"][64]


@pytest.mark.parametrize("tokens", [16, 64])
def test_identical_tokens_in_a_batch_still_route_apart(kimi_topk, monkeypatch, tokens):
    """A random-weight model emits the same token for every request: a decode batch of identical hidden states
    routed to 8 experts on the H200 until the noise row."""
    logits, bias = dummy_router(1, 0)
    module, _, config, _ = with_skew(monkeypatch, kimi_topk, bias, "0")
    ids = routed(module, config, logits.expand(tokens, -1).contiguous()).topk_ids
    assert ids.unique().numel() >= 0.85 * uniform_expectation(tokens)
    noise = synthetic_router.row_noise(4096, EXPERTS)
    assert abs(noise.mean()) < 0.01 and abs(noise.std() - 1) < 0.01
    assert torch.equal(noise, synthetic_router.row_noise(4096, EXPERTS))


def test_the_cached_noise_table_is_the_hash_and_longer_batches_are_hashed_anew():
    cache = synthetic_router.BiasCache(0.25, noise_rows=128)
    logits = torch.zeros(64, EXPERTS)
    assert torch.equal(cache.noise(logits), synthetic_router.row_noise(64, EXPERTS))
    longer = torch.zeros(300, EXPERTS)
    assert cache._noise and torch.equal(cache.noise(longer), synthetic_router.row_noise(300, EXPERTS))
