"""Training data in batches: whole answer sequences, split into train and validation by seed, length-sorted and
right-padded to a token budget per batch."""
from __future__ import annotations

import torch

from experiments.eagle3.features import Features


def split_sequences(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(n, generator=g).tolist()
    n_val = max(1, int(round(n * val_fraction))) if n > 1 else 0
    return sorted(perm[n_val:]), sorted(perm[:n_val])


class Batches:
    """Whole sequences, length-sorted, right-padded to ≤ batch_tokens per batch."""

    def __init__(self, f: Features, seqs: list[int], batch_tokens: int, label_perm: torch.Tensor | None = None):
        self.f = f
        self.device = f.ids.device
        self.label_src = (torch.arange(f.ids.numel()) if label_perm is None else label_perm).to(self.device)
        lens = {s: int(f.offsets[s + 1] - f.offsets[s]) for s in seqs}
        order = sorted(seqs, key=lambda s: lens[s])
        self.batches: list[list[int]] = []
        cur: list[int] = []
        for s in order:
            if cur and (len(cur) + 1) * lens[s] > batch_tokens:
                self.batches.append(cur)
                cur = []
            cur.append(s)
        if cur:
            self.batches.append(cur)

    def __len__(self) -> int:
        return len(self.batches)

    def get(self, i: int) -> dict[str, torch.Tensor]:
        f, seqs = self.f, self.batches[i]
        lens = [int(f.offsets[s + 1] - f.offsets[s]) for s in seqs]
        t = max(lens)
        idx = torch.full((len(seqs), t), -1, dtype=torch.int64)
        valid = torch.zeros(len(seqs), t, dtype=torch.bool)
        for b, s in enumerate(seqs):
            a = int(f.offsets[s])
            idx[b, : lens[b]] = torch.arange(a, a + lens[b])
            valid[b, int(f.prompt_lens[s]): lens[b] - 1] = True   # position p: target predicts answer token p+1
        idx, valid = idx.to(self.device), valid.to(self.device)
        flat = idx.clamp(min=0)
        src = self.label_src[flat]              # the shuffle control takes targets from other positions
        return {"ids": torch.where(idx >= 0, f.ids[flat], 0), "aux": f.aux[flat], "valid": valid,
                "final": f.final[src], "next": torch.where(valid, f.ids[(src + 1).clamp(max=f.ids.numel() - 1)], -1)}
