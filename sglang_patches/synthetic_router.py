"""`synthetic_router`: token-dependent, optionally skewed routing for MoE models served with random weights.

Why: SGLang's dummy loader (`--load-format dummy`, `initialize_dummy_weights`) fills every floating tensor with
U(-1e-3, 1e-3), re-seeding with the same seed for each one. The router logits (RMSNorm weight x gate weight x
hidden, all of that size) are then ~3e-5, so sigmoid(logit) = 0.5 +- 1e-5, while the correction bias (the same
U(-1e-3, 1e-3)) spreads a hundred times wider: every token of every layer picks among the same few experts, those
with the largest bias (8 to 14 for 512 tokens in tests/sglang_patches/test_synthetic_router.py). Distinct experts
per step would stay near 8 whatever the batch, which makes the MoE part of verification look free.

What it does, around SGLang's own `select_experts` (nothing else of SGLang's routing changes): per token, the
router logits are standardised over the experts (zero mean, unit standard deviation; token-dependent where the
hidden states differ) and mixed, 10 % of the variance to 90 %, with a fixed standard-normal noise row chosen by
the token's row in the batch (so tokens with identical hidden states, which a random-weight model's decode
batches are full of, still route apart), and a fixed per-expert popularity bias `s * z_e` is added; then SGLang's
top-k (sigmoid + correction bias + top-8 + renormalisation + routed_scaling_factor) runs on that. z_e are the
standard-normal quantiles Phi^-1((r_e + 0.5) / E) over a seeded permutation r of the experts, so the spread of
popularity does not depend on the luck of a draw. s = 0 is near-uniform routing (the pessimistic case for
distinct experts); s > 0 makes some experts popular (per-expert loads come out close to log-normal, which is
the shape measured on DeepSeek-V3, deepseek-ai/DeepEP#393). Token i picks the top 8 of (g_ie + s z_e) with
g_ie ~ N(0, 1). What s means for E = 384, top-8 (`popularity_stats`, 200,000 tokens):

    s      top 10 % of experts take   max/mean load   expected distinct experts for T = 1 / 8 / 64 / 512 tokens
    0        10 % of routed slots        1.05            8 / 59.5 / 284 / 384   (uniform: 384 (1 - (1 - 8/384)^T))
    0.25     23 %                         4.2            8 / 58.0 / 257 / 381
    0.5      40 %                        10.5            8 / 53.7 / 204 / 345
    1.0      70 %                        27              8 / 41.5 / 121 / 218

Tokens are independent given the bias; real routing is also correlated within a request (the same hot experts
for hundreds of steps, NVIDIA's TensorRT-LLM large-scale EP study), which this does not model.

The bias is the same in every layer and every process (a pure function of E and the seed). Per-layer hot sets
would change nothing measured here: distinct experts are counted per layer, and no two layers share weights.

Plain tensor code without host synchronisation: the bias is built on the device from `arange` (no host copy),
cached only outside CUDA-graph capture, so the transform is captured into SGLang's graphs like the rest of the
forward. Apply it before `moe_budget` and `expert_telemetry` (they then see the synthetic routing); it refuses
to wrap a `select_experts` that one of them already wraps. s comes from SPECWS_ROUTER_SKEW.
"""
from __future__ import annotations

import functools
import math
import os
import random
from typing import TYPE_CHECKING

from sglang_patches import Patch, PatchRefused, Targets, When, register
from sglang_patches.expert_telemetry import graph_capturing
from sglang_patches.moe_budget import MOE_MODEL_TYPES, SELECT_EXPERTS, select_experts_arguments

if TYPE_CHECKING:
    import torch

SKEW_ENV = "SPECWS_ROUTER_SKEW"
SEED = 20260101
WRAPPED_AFTER = ("moe_budget", "expert_telemetry")   # patches that must wrap select_experts after this one
MAX_SKEW = 10.0   # beyond this the bias decides everything: 8 fixed experts again
EPSILON = 1e-12
# share of the routing score's variance that comes from the token's own (random-weight) logits; the rest is the
# row noise. Small, so that identical tokens in a batch route nearly independently (correlation 0.1).
TOKEN_SHARE = 0.1
NOISE_ROWS = 16384   # rows of the cached noise table (SGLang's default max prefill tokens); more are hashed anew


def parse_skew(raw: str | None) -> float:
    """s from the environment; refuses a missing, non-numeric, negative, non-finite or absurd value."""
    try:
        value = float(str(raw).strip())
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and 0.0 <= value <= MAX_SKEW):
        raise PatchRefused(f"synthetic_router: {SKEW_ENV} must be a number in [0, {MAX_SKEW}] (0 = near-uniform "
                           f"routing, larger = more skewed expert popularity), got {raw!r}")
    return value


def expert_permutation(num_experts: int, seed: int = SEED) -> tuple[int, int]:
    """(a, c) of the permutation e -> (a e + c) mod E: a coprime with E, both drawn from `seed`."""
    rng = random.Random(seed * 1_000_003 + num_experts)
    while True:
        a = rng.randrange(1, max(num_experts, 2))
        if math.gcd(a, num_experts) == 1:
            return a, rng.randrange(num_experts)


def popularity_bias(num_experts: int, skew: float, device: torch.device | str = "cpu",
                    seed: int = SEED) -> torch.Tensor:
    """s * z_e, float32 [E]: standard-normal quantiles of a seeded permutation of the experts."""
    import torch
    a, c = expert_permutation(num_experts, seed)
    experts = torch.arange(num_experts, device=device, dtype=torch.int64)
    ranks = (experts * a + c) % num_experts
    quantile = (ranks.to(torch.float64) + 0.5) / num_experts
    return (skew * math.sqrt(2.0) * torch.erfinv(2.0 * quantile - 1.0)).to(torch.float32)


def popularity_stats(skew: float, experts: int = 384, top_k: int = 8, tokens: tuple[int, ...] = (1, 8, 64, 512),
                     samples: int = 200_000, seed: int = 0) -> dict:
    """Monte Carlo of the routing this patch produces: the share of routed slots the top 10 % of experts take,
    max/mean expert load, and the expected distinct experts of T independent tokens (sum_e 1 - (1 - p_e)^T)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    bias, counts = popularity_bias(experts, skew), torch.zeros(experts, dtype=torch.float64)
    for start in range(0, samples, 20_000):
        scores = torch.randn(min(20_000, samples - start), experts, generator=g) + bias
        counts += torch.bincount(scores.topk(top_k, dim=1).indices.flatten(), minlength=experts).double()
    p = counts / counts.sum() * top_k                       # P(expert e is among a token's top-k)
    top = p.sort(descending=True).values[: max(1, experts // 10)].sum() / top_k
    return {"skew": skew, "top10_share": round(float(top), 3), "max_over_mean": round(float(p.max() / p.mean()), 2),
            "distinct": {t: round(float((1 - (1 - p) ** t).sum()), 1) for t in tokens}}


def row_noise(rows: int, experts: int, device: torch.device | str = "cpu", seed: int = SEED) -> torch.Tensor:
    """N(0, 1) float32 [rows, experts], a pure function of (row, expert, seed): an integer hash of `arange`,
    so it needs no generator state and is captured into CUDA graphs like the rest of the forward."""
    import torch
    x = torch.arange(rows * experts, device=device, dtype=torch.int64) + (seed % 2**31) * 2**20
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    u = (x.to(torch.float64) + 0.5) / 2**32
    return (math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)).to(torch.float32).view(rows, experts)


def synthetic_logits(router_logits: torch.Tensor, bias: torch.Tensor,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
    """Per token: logits standardised over experts (TOKEN_SHARE of the variance), a fixed noise row (the rest; the
    sum keeps unit variance, so the skew table above holds) and the popularity bias (float32, same shape). The
    noise row is the token's row in the batch: a model with random weights emits the same tokens for every
    request, so a decode batch holds identical hidden states that would otherwise all route alike (8 distinct
    experts at 16 requests, H200 2026-12-02). `noise` defaults to hashing the rows anew (`BiasCache.noise`
    serves them from a cached table)."""
    logits = router_logits.float()
    mean = logits.mean(dim=-1, keepdim=True)
    std = logits.std(dim=-1, keepdim=True, unbiased=False)
    if noise is None:
        noise = row_noise(logits.shape[0], logits.shape[-1], logits.device)
    own = (logits - mean) / (std + EPSILON)
    return math.sqrt(TOKEN_SHARE) * own + math.sqrt(1.0 - TOKEN_SHARE) * noise + bias


class BiasCache:
    """The bias per (device, E) and the noise rows, built on first use; never cached from inside a CUDA-graph
    capture (a tensor made there holds nothing until the graph replays). The hash that makes the noise costs
    ~60 us a layer on the H200 as a dozen small kernels: a cached table is one slice."""

    def __init__(self, skew: float, noise_rows: int = NOISE_ROWS):
        self.skew = skew
        self.noise_rows = noise_rows
        self._cache: dict[tuple[str, int], torch.Tensor] = {}
        self._noise: dict[tuple[str, int], torch.Tensor] = {}

    def noise(self, router_logits: torch.Tensor) -> torch.Tensor:
        rows, key = int(router_logits.shape[0]), (str(router_logits.device), int(router_logits.shape[-1]))
        table = self._noise.get(key)
        if table is None and not graph_capturing():
            table = self._noise[key] = row_noise(self.noise_rows, key[1], router_logits.device)
        if table is None or rows > table.shape[0]:
            return row_noise(rows, key[1], router_logits.device)
        return table[:rows]

    def __call__(self, router_logits: torch.Tensor) -> torch.Tensor:
        key = (str(router_logits.device), int(router_logits.shape[-1]))
        bias = self._cache.get(key)
        if bias is None:
            bias = popularity_bias(key[1], self.skew, router_logits.device)
            if not graph_capturing():
                self._cache[key] = bias
        return bias


def _apply(t: Targets) -> None:
    skew = parse_skew(os.environ.get(SKEW_ENV))
    current = t.current(SELECT_EXPERTS)
    if (already := getattr(current, "__specws_patch__", None)) in WRAPPED_AFTER:
        raise PatchRefused(f"synthetic_router: apply it before {already} (name it first), so that {already} sees "
                           "the synthetic routing")
    arguments = select_experts_arguments(current)
    bias_for = BiasCache(skew)

    @functools.wraps(current)
    def select_experts(*args, **kwargs):
        router_logits, _, _ = arguments(args, kwargs)
        new_logits = synthetic_logits(router_logits, bias_for(router_logits), bias_for.noise(router_logits))
        if "router_logits" in kwargs:
            return current(*args, **{**kwargs, "router_logits": new_logits})
        return current(*args[:1], new_logits, *args[2:], **kwargs)

    select_experts.__specws_patch__ = "synthetic_router"
    t.replace(SELECT_EXPERTS, select_experts)


PATCH = register(Patch(
    name="synthetic_router",
    fixes="random (dummy) weights route every token to the same 8 experts (the correction bias dominates "
          "logits of ~3e-5); per token, mix the standardised router logits with a fixed noise row per batch position "
          f"and add a fixed popularity bias of skew s ({SKEW_ENV}) before SGLang's own top-k, so distinct experts "
          "per step grow with the batch",
    link="https://github.com/sgl-project/sglang/blob/v0.5.14/python/sglang/srt/model_loader/weight_utils.py",
    sglang_versions=">=0.5.14,<0.6",
    when=When(model_types=MOE_MODEL_TYPES),
    targets=(SELECT_EXPERTS,),
    apply=_apply,
))

