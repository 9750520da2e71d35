"""moe_budget inside a captured CUDA graph: SGLang captures option E's verify forwards, and a capture refuses
any host-to-device copy. On the CPU, the pattern that made one (seen on the H200) is looked for on meta tensors;
on a GPU, the routing is captured and replayed."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.config.kimi import KIMI
from sglang_patches.moe_budget import budget_topk

EXPERTS, TOP_K, TOKENS = KIMI.routed_experts, KIMI.top_k, 20   # Kimi-K2.5's routing; 4 sequences x 5 verified tokens


class ScalarIndexPuts(TorchDispatchMode):
    """Records every index_put_ of a value made from a Python scalar (`t[idx] = True`): on CUDA, PyTorch builds
    that value on the host and copies it over, which a CUDA graph capture refuses. On meta tensors nothing is
    copied, so the op itself is what is looked for."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default) and args[2].dim() == 0:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def routing(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    weights, ids = logits.sigmoid().topk(TOP_K, dim=1)
    return weights.to(device), ids.int().to(device), logits.to(device)


@pytest.mark.parametrize("budget", [64, 16])
def test_budgeted_routing_sets_no_index_from_a_host_scalar(budget: int) -> None:
    weights, ids, logits = routing("meta")
    with ScalarIndexPuts() as mode:
        budget_topk(weights, ids, logits, budget, "sigmoid", torch.zeros(EXPERTS, device="meta"))
    assert mode.found == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_budgeted_routing_replays_in_a_cuda_graph_as_eager() -> None:
    weights, ids, logits = routing("cuda")
    bias = torch.zeros(EXPERTS, device="cuda")
    eager = budget_topk(weights, ids, logits, 16, "sigmoid", bias)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):   # warm-up outside the capture, as SGLang's capture does
        budget_topk(weights, ids, logits, 16, "sigmoid", bias)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = budget_topk(weights, ids, logits, 16, "sigmoid", bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[1], eager[1]) and torch.allclose(captured[0], eager[0])
