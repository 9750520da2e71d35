"""The EAGLE-3 draft head in plain torch, laid out exactly like vLLM's `Eagle3LlamaForCausalLM` and SGLang's
`LlamaForCausalLMEagle3` (llama_eagle3.py in both), so its state dict is the checkpoint they load.

One draft step at sequence position p (vLLM's first pass: p is a target position, `hidden` is
`fc(aux hidden states of p)`, the token is the one at p + 1; later steps: `hidden` is the head's own pre-norm
output of the previous step and the token is the one it proposed):

    residual = hidden
    x = cat[input_layernorm(embed(token)), hidden_norm(hidden)]        # 2H → q/k/v
    x = self_attn(x) + residual; residual = x
    pre = mlp(post_attention_layernorm(x)) + residual                  # → next step's `hidden`
    logits = lm_head(norm(pre))                                        # draft vocab; target id = d2t[i] + i

Aux layer ids follow vLLM's convention: id k is the residual stream entering target layer k, i.e.
transformers' `hidden_states[k]` (0 = embeddings). SGLang adds 1 to ids read from the config (it captures the
output of layer k), so an SGLang copy of the checkpoint carries ids − 1 (see export.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high choice; vLLM's `get_eagle3_default_aux_hidden_state_layers`. For a shallow
    target (the 4-layer small MoE: vLLM's formula gives 2, 2, 1) three distinct layers spread over 1..L-1; the
    head's config records them, so the engines capture those."""
    ids = (2, num_layers // 2, num_layers - 3)
    if list(ids) == sorted(set(ids)):
        return ids
    return (1, num_layers // 2, num_layers - 1) if num_layers >= 4 else tuple(range(num_layers))[-3:]


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int                      # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    target_num_layers: int = 0

    @classmethod
    def from_target(cls, cfg, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None) -> HeadConfig:
        """From a transformers LlamaConfig of the target (rope theta from `rope_parameters` or `rope_theta`)."""
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        heads = cfg.num_attention_heads
        layers = cfg.num_hidden_layers
        ids = tuple(aux_layer_ids or default_aux_layer_ids(layers))
        if list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < layers:
            # vLLM captures sorted(set(ids)): repeated or unsorted ids would not match fc's input layout
            raise ValueError(f"aux layer ids {ids} must be distinct, increasing and within 0..{layers - 1}")
        return cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=cfg.num_key_value_heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=theta,
                   max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, cfg.vocab_size),
                   aux_layer_ids=ids, target_num_layers=layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (vLLM's default for Llama); x [B, heads, T, D], positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Llama attention whose q/k/v take 2H inputs. `cache` holds (k, v) of earlier unrolled steps: step 0's
    keys cover every position (causal); a later step's query also sees, at its own position only, the keys
    of steps 1..k — what the draft KV cache holds when vLLM drafts step k after anchor position t."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.h, self.kv, self.d, self.theta = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta
        self.q_proj = nn.Linear(2 * c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = _rope(q, positions, self.theta), _rope(k, positions, self.theta)
        cache.append((k, v))
        if len(cache) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            g = self.h // self.kv
            qg = q.view(b, self.kv, g, t, self.d)
            scale = 1.0 / math.sqrt(self.d)
            k0, v0 = cache[0]
            s0 = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)) * scale           # [b, kv, g, t, t]
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            s0 = s0.masked_fill(causal, float("-inf"))
            diag = [(qg * kj.unsqueeze(2)).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]
            p = torch.softmax(torch.cat([s0, *diag], -1).float(), -1).to(q.dtype)
            out = torch.matmul(p[..., :t], v0.unsqueeze(2))
            for j, (_, vj) in enumerate(cache[1:]):
                out = out + p[..., t + j: t + j + 1] * vj.unsqueeze(2)
            out = out.reshape(b, self.h, t, self.d)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        x = self.self_attn(x, positions, cache) + residual
        return self.mlp(self.post_attention_layernorm(x)) + x          # pre-norm output


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head, buffers d2t / t2d. The target's token embeddings are a frozen,
    non-persistent buffer: shared with the target at serving time, never exported."""

    def __init__(self, c: HeadConfig, embed_weight: torch.Tensor) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_weight", embed_weight.detach().float(), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft-vocab entry."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        ids = torch.sort(draft_ids.to(torch.int64)).values
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def init_from_target(self, final_norm_weight: torch.Tensor) -> None:
        """lm_head ← the target's (tied) output rows of the draft vocab, norm ← the target's final norm:
        the head starts out predicting through the target's own output projection."""
        with torch.no_grad():
            self.lm_head.weight.copy_(self.embed_weight[self.draft_ids])
            self.norm.weight.copy_(final_norm_weight.float())

    def unroll(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences. input_ids [B, T] target ids, aux [B, T, n*H].
        Step k at anchor i: position i + k, token input_ids[i + k + 1], predicts the token at i + k + 2.
        Returns each step's pre-norm output [B, T, H] (positions past the end are junk); `logits` maps it."""
        _, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device)
        hidden = self.fc(aux)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        for k in range(steps):
            tok = F.pad(input_ids[:, k + 1:], (0, k + 1))
            emb = F.embedding(tok, self.embed_weight).to(hidden.dtype)
            hidden = self.midlayer(emb, hidden, pos + k, cache)
            outs.append(hidden)
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of pre-norm outputs; the target id of draft entry j is d2t[j] + j."""
        return self.lm_head(self.norm(hidden))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors, named as design.md / vLLM / SGLang expect (no embed_tokens)."""
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}


def select_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target ids (ties and never-seen tokens: lower id first — BPE ids
    are roughly frequency-ordered), sorted ascending."""
    order = torch.sort(-token_counts.to(torch.float64), stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values
