"""experiments/eagle3/batches.py: the train/validation split by seed, whole sequences batched length-sorted under a
token budget (a sequence over it alone in its batch), and a batch's tensors -- right padding, the positions trained
on (answer positions that have a next token), the next-token targets and the shuffle control's label source."""
from __future__ import annotations

import torch

from experiments.eagle3.batches import Batches, split_sequences
from experiments.eagle3.features import Features

# three sequences of 5, 3 and 4 tokens (prompts of 2, 1 and 1), packed end to end; token i is 100 + i
OFFSETS, PROMPTS = [0, 5, 8, 12], [2, 1, 1]


def _features() -> Features:
    n = OFFSETS[-1]
    return Features(ids=100 + torch.arange(n), offsets=torch.tensor(OFFSETS), prompt_lens=torch.tensor(PROMPTS),
                    aux=torch.arange(n * 6, dtype=torch.bfloat16).reshape(n, 6),
                    final=torch.arange(n * 2, dtype=torch.bfloat16).reshape(n, 2), aux_layer_ids=(1, 2, 3),
                    kinds=["chat"] * 3)


def test_split_is_a_partition_fixed_by_the_seed() -> None:
    train, val = split_sequences(10, 0.2, seed=0)
    assert sorted(train + val) == list(range(10)) and len(val) == 2
    assert (train, val) == split_sequences(10, 0.2, seed=0)
    assert val != split_sequences(10, 0.2, seed=1)[1] or val != split_sequences(10, 0.2, seed=2)[1]


def test_split_keeps_one_validation_sequence_and_none_of_one() -> None:
    assert len(split_sequences(10, 0.0, seed=0)[1]) == 1
    assert split_sequences(1, 0.5, seed=0) == ([0], [])


def test_sequences_are_batched_shortest_first_under_the_budget() -> None:
    batches = Batches(_features(), [0, 1, 2], batch_tokens=8)
    assert batches.batches == [[1, 2], [0]] and len(batches) == 2
    assert Batches(_features(), [0, 1, 2], batch_tokens=2).batches == [[1], [2], [0]]   # each over it: alone
    assert Batches(_features(), [0, 2], batch_tokens=100).batches == [[2, 0]]


def test_a_batch_is_right_padded_and_trains_on_answer_positions_with_a_next_token() -> None:
    f = _features()
    batch = Batches(f, [0, 1, 2], batch_tokens=8).get(0)      # sequences 1 (3 tokens) and 2 (4 tokens)
    assert batch["ids"].tolist() == [[105, 106, 107, 0], [108, 109, 110, 111]]
    assert batch["valid"].tolist() == [[False, True, False, False], [False, True, True, False]]
    assert batch["next"].tolist() == [[-1, 107, -1, -1], [-1, 110, 111, -1]]
    assert torch.equal(batch["aux"][1], f.aux[8:12]) and torch.equal(batch["final"][0, :3], f.final[5:8])
    assert batch["aux"].shape == (2, 4, 6) and batch["final"].shape == (2, 4, 2)


def test_the_shuffle_control_takes_targets_from_the_permuted_positions() -> None:
    f = _features()
    perm = torch.arange(11, -1, -1)                           # position i takes its labels from 11 - i
    batch = Batches(f, [1], batch_tokens=8, label_perm=perm).get(0)   # sequence 1: positions 5, 6, 7
    assert torch.equal(batch["final"][0], f.final[[6, 5, 4]])
    assert batch["next"].tolist() == [[-1, 106, -1]]          # position 6 -> source 5 -> next token 106
    assert batch["ids"].tolist() == [[105, 106, 107]]         # inputs are not permuted
