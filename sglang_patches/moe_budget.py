"""`moe_budget`: the MoE-Spec expert budget (arXiv 2602.16052) around SGLang's own top-k.

During verification only (ForwardMode.TARGET_VERIFY), every MoE layer keeps the B experts with the highest
aggregated routing weight over all tokens of the forward (all sequences x (k+1) tokens), and each token's
top-k is re-routed within them: a token keeps its own picks that survived; a dropped pick is replaced by
the token's best remaining kept expert (by score + correction bias, the quantity DeepSeek-V3 chooses by);
the weights are the token's scores over its new experts, renormalised to the total its original weights had
(so renormalisation and `routed_scaling_factor` conventions carry over). Tokens whose picks all survived are
returned bit-for-bit unchanged, so B >= the number of experts reproduces the unbudgeted routing exactly.
With B < top_k a token keeps at most B experts; the empty slots get weight 0. Decode, prefill and draft
forwards are untouched.

The budget is plain tensor code without host synchronisation, so it is captured into SGLang's CUDA graph
for target-verify like the rest of the forward. B comes from SPECWS_MOE_EXPERT_BUDGET (applied in every
SGLang process by the launcher). `budget_topk` is also what the offline (HF) measurement applies.
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_patches import Patch, PatchRefused, Targets, When, register

SELECT_EXPERTS = "sglang.srt.layers.moe.topk:select_experts"
MODEL_FORWARD = "sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM.forward"
BUDGET_ENV = "SPECWS_MOE_EXPERT_BUDGET"
BUDGET_FILE_ENV = "SPECWS_MOE_EXPERT_BUDGET_FILE"
if TYPE_CHECKING:
    import torch

MOE_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2", "kimi_k25")


def expert_scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"moe_budget: unsupported scoring_func {scoring_func!r}")


def budget_topk(topk_weights: torch.Tensor, topk_ids: torch.Tensor, router_logits: torch.Tensor, budget: int,
                scoring_func: str = "sigmoid", correction_bias: torch.Tensor | None = None,
                num_token_non_padded: torch.Tensor | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict one layer's routing of one forward to `budget` experts (see the module docstring).

    topk_weights/topk_ids: [tokens, k] from the unbudgeted top-k; router_logits: [tokens, experts].
    Slots holding ids outside [0, experts) (fused shared experts, padding markers) are left alone."""
    import torch  # lazily: importing the registry must not need torch
    num_experts = router_logits.shape[-1]
    if budget >= num_experts:
        return topk_weights, topk_ids
    if budget < 1:
        raise ValueError(f"moe_budget: budget must be >= 1, got {budget}")
    tokens = topk_ids.shape[0]
    routed = (topk_ids >= 0) & (topk_ids < num_experts)
    if num_token_non_padded is not None:
        real = torch.arange(tokens, device=topk_ids.device) < num_token_non_padded
        routed_real = routed & real[:, None]
    else:
        routed_real = routed
    safe_ids = torch.where(routed, topk_ids, torch.zeros_like(topk_ids)).long()
    weights = topk_weights.float()
    aggregated = torch.zeros(num_experts, device=weights.device, dtype=torch.float32)
    aggregated.scatter_add_(0, safe_ids.reshape(-1), torch.where(routed_real, weights, 0.0).reshape(-1))
    scores = expert_scores(router_logits, scoring_func)
    # Experts some token picked rank above all others (1 + weight > 1 > any mean score), the rest by mean score.
    rank_key = torch.where(aggregated > 0, 1.0 + aggregated, scores.mean(0))
    # index_fill_, not `kept[idx] = True`: that copies a host tensor to the device, which a CUDA graph capture
    # refuses (seen on the H200: option E's verify graphs failed to capture at B < experts)
    kept = torch.zeros(num_experts, device=weights.device, dtype=torch.bool).index_fill_(
        0, rank_key.topk(budget).indices, True)

    survived = ~routed | kept[safe_ids]
    choice = scores + (correction_bias.float() if correction_bias is not None else 0.0)
    own_kept = torch.zeros_like(choice, dtype=torch.bool).scatter_(1, safe_ids, routed & survived)
    choice = choice.masked_fill(~kept[None, :] | own_kept, float("-inf"))
    k = topk_ids.shape[1]
    fill_val, fill_ids = choice.topk(min(k, num_experts), dim=1)
    slot = (~survived).long().cumsum(1) - 1                      # n-th dropped slot takes the n-th substitute
    slot = slot.clamp(min=0, max=fill_ids.shape[1] - 1)
    sub_ok = fill_val.gather(1, slot) > float("-inf")
    # A slot left empty (fewer than k kept experts for this token) points at the top kept expert with weight 0,
    # so that no expert outside the budget is touched (the fused MoE moves the weights of every id it sees).
    sub_ids = torch.where(sub_ok, fill_ids.gather(1, slot), rank_key.argmax())
    new_ids = torch.where(survived, safe_ids, sub_ids)
    live = survived | sub_ok
    new_scores = scores.gather(1, new_ids) * live
    total = torch.where(routed, weights, 0.0).sum(1, keepdim=True)
    new_weights = new_scores / new_scores.sum(1, keepdim=True).clamp(min=1e-20) * total
    new_weights = torch.where(routed, new_weights, weights)     # shared-expert slots keep their weight
    changed = (~survived).any(1, keepdim=True)
    out_ids = torch.where(changed, torch.where(routed, new_ids, topk_ids.long()), topk_ids.long())
    out_weights = torch.where(changed, new_weights, weights)
    return out_weights.to(topk_weights.dtype), out_ids.to(topk_ids.dtype)


class BudgetSource:
    """B from SPECWS_MOE_EXPERT_BUDGET, or, when SPECWS_MOE_EXPERT_BUDGET_FILE names a file, from that file,
    re-read whenever it changes: one server then serves a whole B grid. The file form is for runs without
    CUDA graphs (a captured graph keeps the B it was captured with)."""

    def __init__(self) -> None:
        self.file = os.environ.get(BUDGET_FILE_ENV)
        self._stamp: float | None = None
        self.value = parse_budget(Path(self.file).read_text() if self.file else os.environ.get(BUDGET_ENV, ""))

    def __call__(self) -> int:
        if self.file:
            stamp = os.stat(self.file).st_mtime_ns
            if stamp != self._stamp:
                self.value, self._stamp = parse_budget(Path(self.file).read_text()), stamp
        return self.value


def parse_budget(raw: str) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise PatchRefused(f"moe_budget: the expert budget ({BUDGET_ENV} or the file in {BUDGET_FILE_ENV}) must be "
                           f"a positive integer, got {raw!r}")
    return value


def refuse_unless_moe(config: dict) -> None:
    """The budget only means something on a model with routed experts; refuse others by name."""
    text = config.get("text_config") or config
    if not text.get("n_routed_experts"):
        raise PatchRefused(f"moe_budget: model type {config.get('model_type')!r} has no routed experts "
                           f"(no n_routed_experts in config.json); the expert budget does not apply")


# --- the forward mode of the running model forward, shared by the MoE patches -------------------------------

_forward_state = threading.local()


def current_forward_batch():
    """The ForwardBatch of the DeepSeek-V2/V3 forward running in this thread, or None."""
    return getattr(_forward_state, "batch", None)


def is_target_verify(forward_batch) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return bool(mode is not None and mode.is_target_verify())


def track_forward_batch(t: Targets, patch_name: str) -> None:
    """Wrap the model's forward so that code inside it can see the forward batch (its mode, batch size)."""
    if getattr(t.current(MODEL_FORWARD), "__specws_tracks_forward__", False):
        return   # another MoE patch already tracks it
    original = t.current(MODEL_FORWARD)
    params = list(inspect.signature(original).parameters)
    at = params.index("forward_batch") if "forward_batch" in params else 3

    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = kwargs.get("forward_batch", args[at] if len(args) > at else None)
        outer = current_forward_batch()
        _forward_state.batch = batch
        try:
            return original(*args, **kwargs)
        finally:
            _forward_state.batch = outer

    forward.__specws_patch__ = patch_name
    forward.__specws_tracks_forward__ = True
    t.replace(MODEL_FORWARD, forward)


def select_experts_arguments(original):
    """A function mapping select_experts' (args, kwargs) to (router_logits, topk_config, num_token_non_padded)."""
    sig = inspect.signature(original)

    def arguments(args, kwargs):
        bound = sig.bind_partial(*args, **kwargs).arguments
        return bound.get("router_logits"), bound.get("topk_config"), bound.get("num_token_non_padded")
    return arguments


def budgeted_output(output, router_logits, topk_config, num_token_non_padded, budget: int):
    """Apply the budget to a StandardTopKOutput (topk_weights, topk_ids, router_logits)."""
    fields = getattr(output, "_fields", ())
    if "topk_weights" not in fields or "topk_ids" not in fields:
        raise RuntimeError(f"moe_budget: top-k output {type(output).__name__} is not the standard format; "
                           "serve with a MoE runner backend that uses it (--moe-runner-backend triton)")
    bias = getattr(topk_config, "correction_bias", None)
    scoring = getattr(topk_config, "scoring_func", None) or ("sigmoid" if bias is not None else "softmax")
    weights, ids = budget_topk(output.topk_weights, output.topk_ids, router_logits, budget, scoring, bias,
                               num_token_non_padded)
    return output._replace(topk_weights=weights, topk_ids=ids)


def _apply(t: Targets) -> None:
    budget = BudgetSource()
    if getattr(t.current(SELECT_EXPERTS), "__specws_patch__", None) == "expert_telemetry":
        raise PatchRefused("moe_budget: apply it before expert_telemetry (name it first), so that the telemetry "
                           "counts the budgeted experts")
    track_forward_batch(t, "moe_budget")
    original = t.current(SELECT_EXPERTS)   # current, not as resolved: composes with expert_telemetry
    arguments = select_experts_arguments(original)

    @functools.wraps(original)
    def select_experts(*args, **kwargs):
        output = original(*args, **kwargs)
        if not is_target_verify(current_forward_batch()):
            return output
        router_logits, topk_config, num_token_non_padded = arguments(args, kwargs)
        # the logits the top-k really ran on: a wrapper applied earlier (synthetic_router) may have replaced them
        ran_on = getattr(output, "router_logits", None)
        router_logits = ran_on if ran_on is not None else router_logits
        return budgeted_output(output, router_logits, topk_config, num_token_non_padded, budget())

    select_experts.__specws_patch__ = "moe_budget"
    t.replace(SELECT_EXPERTS, select_experts)


PATCH = register(Patch(
    name="moe_budget",
    fixes="MoE-Spec expert budget: verifying k draft tokens touches many more distinct experts per MoE layer "
          "than decoding one token; during target-verify forwards each layer keeps the B experts with the "
          "highest aggregated routing weight and re-routes every token's top-k within them (B from "
          f"{BUDGET_ENV}; decode untouched)",
    link="https://arxiv.org/abs/2602.16052",
    sglang_versions=">=0.5.14,<0.6",
    when=When(model_types=MOE_MODEL_TYPES),
    targets=(SELECT_EXPERTS, MODEL_FORWARD),
    apply=_apply,
))
