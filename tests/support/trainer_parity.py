"""Builders for the in-process trainer parity tests (1 rank against a parallel layout, the same data and global
batch): deterministic masked samples, Megatron's pretraining sampler per data-parallel rank, a constant schedule."""
from __future__ import annotations

import torch


def masked_samples(count: int, seq: int, seed: int, varying_mask: bool = False) -> list:
    """`count` samples of `seq` tokens from a small vocabulary (24 ids: learnable fast) with loss masks; with
    `varying_mask` each sample keeps a different share of its tokens (a wrong loss normalisation then shows)."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 24, (count, seq + 1), generator=gen)
    if varying_mask:
        mask = (torch.rand(count, seq, generator=gen) > torch.rand(count, 1, generator=gen) * 0.8).float()
    else:
        mask = (torch.rand(count, seq, generator=gen) > 0.3).float()
    return [dict(tokens=t[:-1], labels=t[1:], loss_mask=m, position_ids=torch.arange(seq))
            for t, m in zip(text, mask)]


def rank_micro_batches(samples: list, dp: int, rank: int, mbs: int):
    """Megatron's pretraining sampler: each group of mbs x dp samples, rank r takes its mbs slice."""
    for start in range(0, len(samples), mbs * dp):
        chunk = samples[start + rank * mbs:start + (rank + 1) * mbs]
        yield {k: torch.stack([s[k] for s in chunk]) for k in chunk[0]}


class ConstantLR:
    """A scheduler that keeps the optimizer's learning rate."""

    def step(self, increment):
        pass
