"""Target features for EAGLE-3 training: the target run over prompt + answer token ids.

Per token it keeps the aux hidden states the engine will hand the head (vLLM's convention: aux id k is the
residual stream entering layer k, which is transformers' `hidden_states[k]`; vLLM's `_maybe_add_hidden_state`
captures layer_idx 0 = embeddings and idx + 1 after layer idx) and the target's final, normed hidden state:
the target distribution is `softmax(final @ lm_head.T)`, recomputed on the fly over the draft vocabulary
instead of storing 49k logits per token. Cached under `<cache>/eagle3/features/<hash>.pt`.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from experiments.eagle3.data import DataSettings, eagle3_cache, load_rows
from experiments.eagle3.sharegpt_data import ShareGPTSettings


@dataclass(frozen=True)
class FeatureSettings:
    data: DataSettings | ShareGPTSettings
    aux_layer_ids: tuple[int, ...]
    dtype: str = "float32"
    tokens_per_batch: int = 4096
    device: str = "cpu"

    def key(self) -> str:
        blob = json.dumps({"data": self.data.key(), "aux": list(self.aux_layer_ids), "dtype": self.dtype,
                           "tpb": self.tokens_per_batch, **({"device": self.device} if self.device != "cpu" else {})},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Features:
    """Sequences packed end to end: sequence s is tokens offsets[s]:offsets[s+1]; its answer starts at
    offsets[s] + prompt_lens[s]."""
    ids: torch.Tensor           # [N] int64 target token ids
    offsets: torch.Tensor       # [S + 1]
    prompt_lens: torch.Tensor   # [S]
    aux: torch.Tensor           # [N, n_aux * H] bfloat16
    final: torch.Tensor         # [N, H] bfloat16: the target's normed last hidden state
    aux_layer_ids: tuple[int, ...]
    kinds: list[str]

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    def response_token_counts(self, vocab_size: int, sequences: list[int] | None = None) -> torch.Tensor:
        keep = torch.zeros(self.ids.numel(), dtype=torch.bool)
        for s in range(self.num_sequences) if sequences is None else sequences:
            keep[int(self.offsets[s] + self.prompt_lens[s]): int(self.offsets[s + 1])] = True
        return torch.bincount(self.ids[keep.to(self.ids.device)], minlength=vocab_size).cpu()

    def to(self, device: str | torch.device) -> Features:
        """Token ids and features on `device` (offsets and lengths stay on the CPU: they drive Python loops)."""
        self.ids, self.aux, self.final = self.ids.to(device), self.aux.to(device), self.final.to(device)
        return self

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".partial")
        torch.save({**{k: getattr(self, k) if k == "kinds" else getattr(self, k).cpu()
                       for k in ("ids", "offsets", "prompt_lens", "aux", "final", "kinds")},
                    "aux_layer_ids": list(self.aux_layer_ids)}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Features:
        d = torch.load(path, weights_only=True)
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


def extract(rows: list[dict], model, aux_layer_ids: tuple[int, ...], tokens_per_batch: int = 4096,
            progress: Callable[[str], None] = print) -> Features:
    """Run `model` (a transformers causal LM, eval mode) over each row's prompt_ids + response_ids. The
    features stay on the model's device (a GPU holds millions of tokens' worth; the CPU path is unchanged)."""
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    n_tok = sum(len(s) for s in seqs)
    hidden = model.config.hidden_size
    dev = model.device
    aux = torch.empty(n_tok, len(aux_layer_ids) * hidden, dtype=torch.bfloat16, device=dev)
    final = torch.empty(n_tok, hidden, dtype=torch.bfloat16, device=dev)
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    backbone = model.get_decoder()
    t0, done, i = time.time(), 0, 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= tokens_per_batch:
            j += 1
        batch = order[i:j]
        width = len(seqs[batch[-1]])
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for b, s in enumerate(batch):
            ids[b, : len(seqs[s])] = torch.tensor(seqs[s])
            mask[b, : len(seqs[s])] = 1
        with torch.inference_mode():
            out = backbone(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True,
                           use_cache=False)
        hs = out.hidden_states
        for b, s in enumerate(batch):
            n, a = len(seqs[s]), int(offsets[s])
            aux[a: a + n] = torch.cat([hs[k][b, :n] for k in aux_layer_ids], -1).to(torch.bfloat16)
            final[a: a + n] = out.last_hidden_state[b, :n].to(torch.bfloat16)
        done += len(batch)
        if dev.type == "cpu" or j == len(order):
            progress(f"eagle3 features: {done}/{len(seqs)} sequences, {time.time() - t0:.0f}s")
        i = j
    return Features(ids=torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=dev),
                    offsets=offsets,
                    prompt_lens=torch.tensor([len(r["prompt_ids"]) for r in rows], dtype=torch.int64),
                    aux=aux, final=final, aux_layer_ids=tuple(aux_layer_ids), kinds=[r["kind"] for r in rows])


def build_features(s: FeatureSettings, progress: Callable[[str], None] = print) -> Path:
    """Data (cached) → features (cached); returns the features path."""
    out = eagle3_cache() / "features" / f"{s.key()}.pt"
    if out.exists():
        return out
    from transformers import AutoModelForCausalLM

    rows = load_rows(s.data.build(progress))
    model = AutoModelForCausalLM.from_pretrained(s.data.model_path, dtype=getattr(torch, s.dtype)).eval().to(s.device)
    n_layers = model.config.num_hidden_layers
    if not all(0 <= k < n_layers for k in s.aux_layer_ids):  # hidden_states[n_layers] is post-norm in transformers
        raise ValueError(f"aux layer ids {s.aux_layer_ids} outside 0..{n_layers - 1}")
    feats = extract(rows, model, s.aux_layer_ids, s.tokens_per_batch, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    feats.save(out)
    (out.with_suffix(".json")).write_text(json.dumps({"data": asdict(s.data), "aux_layer_ids": s.aux_layer_ids,
                                                      "dtype": s.dtype, "tokens": int(feats.ids.numel())}))
    return out
