"""`expert_telemetry`: distinct routed experts per MoE layer per forward, for the served measurement.

Wraps SGLang's `select_experts` (after `moe_budget` when both are applied, so it counts the experts actually
used) and the DeepSeek-V2/V3 model forward (for the forward mode and batch size). At the end of every
decode / target-verify / extend forward it appends one JSON line to
`$SPECWS_EXPERT_TELEMETRY_DIR/experts-<pid>.jsonl`:
`{"mode": "decode"|"target_verify"|..., "bs": sequences, "tokens": tokens, "distinct": [per MoE layer]}`.

Counting synchronises with the device (`unique`), which CUDA-graph capture forbids: while a graph is being
captured nothing is counted, and graph replays run no Python — so serve with `--disable-cuda-graph` for
telemetry (the H200 script does). The throughput runs leave this patch out.
"""
from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_patches import Patch, PatchRefused, Targets, When, register
from sglang_patches.moe_budget import (
    BUDGET_ENV,
    BUDGET_FILE_ENV,
    MODEL_FORWARD,
    MOE_MODEL_TYPES,
    SELECT_EXPERTS,
    BudgetSource,
    current_forward_batch,
    select_experts_arguments,
    track_forward_batch,
)

if TYPE_CHECKING:
    import torch

DIR_ENV = "SPECWS_EXPERT_TELEMETRY_DIR"
_layers = threading.local()


def distinct_experts(topk_ids: torch.Tensor, num_experts: int, num_tokens: int | None = None) -> int:
    """Distinct routed experts among the first `num_tokens` rows (ids outside [0, experts) do not count)."""
    import torch
    ids = topk_ids if num_tokens is None else topk_ids[:num_tokens]
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return int(torch.unique(ids).numel())


def mode_name(forward_batch) -> str:
    mode = getattr(forward_batch, "forward_mode", None)
    return getattr(mode, "name", str(mode)).lower() if mode is not None else "unknown"


def graph_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (graph replays run no Python)."""
    import torch
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _apply(t: Targets) -> None:
    out_dir = os.environ.get(DIR_ENV)
    if not out_dir:
        raise PatchRefused(f"expert_telemetry: {DIR_ENV} is not set (where each process writes its counts)")
    path = Path(out_dir) / f"experts-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    track_forward_batch(t, "expert_telemetry")
    budget = BudgetSource() if (os.environ.get(BUDGET_ENV) or os.environ.get(BUDGET_FILE_ENV)) else None
    original_select = t.current(SELECT_EXPERTS)      # composes with moe_budget applied before it
    arguments = select_experts_arguments(original_select)

    @functools.wraps(original_select)
    def select_experts(*args, **kwargs):
        output = original_select(*args, **kwargs)
        counts = getattr(_layers, "counts", None)
        if counts is not None and not graph_capturing():
            router_logits, _, num_token_non_padded = arguments(args, kwargs)
            n = int(num_token_non_padded) if num_token_non_padded is not None else None
            counts.append(distinct_experts(output.topk_ids, router_logits.shape[-1], n))
        return output

    tracked_forward = t.current(MODEL_FORWARD)

    @functools.wraps(tracked_forward)
    def forward(*args, **kwargs):
        outer = getattr(_layers, "counts", None)
        _layers.counts = []
        try:
            result = tracked_forward(*args, **kwargs)
            batch = current_forward_batch_of(args, kwargs)
            if _layers.counts and batch is not None:
                record = {"mode": mode_name(batch), "budget": budget() if budget else None,
                          "bs": int(getattr(batch, "batch_size", 0) or 0),
                          "tokens": int(args_tokens(args, kwargs)), "distinct": _layers.counts}
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            return result
        finally:
            _layers.counts = outer

    forward.__specws_patch__ = "expert_telemetry"
    forward.__specws_tracks_forward__ = True
    select_experts.__specws_patch__ = "expert_telemetry"
    t.replace(SELECT_EXPERTS, select_experts)
    t.replace(MODEL_FORWARD, forward)


def current_forward_batch_of(args, kwargs):
    """The forward batch passed to the model forward (keyword or third positional after self)."""
    batch = kwargs.get("forward_batch")
    if batch is None and len(args) > 3:
        batch = args[3]
    return batch if batch is not None else current_forward_batch()


def args_tokens(args, kwargs) -> int:
    input_ids = kwargs.get("input_ids", args[1] if len(args) > 1 else None)
    return int(input_ids.shape[0]) if input_ids is not None else 0


PATCH = register(Patch(
    name="expert_telemetry",
    fixes="instrumentation, not a fix: counts distinct routed experts per MoE layer per forward (decode vs "
          f"target-verify) into {DIR_ENV}/experts-<pid>.jsonl, the served side of the expert-growth curve "
          "(needs --disable-cuda-graph)",
    link="https://arxiv.org/abs/2506.20675",
    sglang_versions=">=0.5.14,<0.6",
    when=When(model_types=MOE_MODEL_TYPES),
    targets=(SELECT_EXPERTS, MODEL_FORWARD),
    apply=_apply,
))
