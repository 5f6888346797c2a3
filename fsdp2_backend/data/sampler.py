"""Megatron's pretraining batch samplers (`--dataloader-type single` and `cyclic`), written from Megatron-LM's
semantics (megatron/training/datasets/data_samplers.py) so that a migrated run sees the same sample indices.

- `MegatronPretrainingSampler` (single): walks indices consumed_samples, consumed_samples + 1, ... in order (the
  dataset already shuffles); every micro_batch_size x dp_size indices, rank r takes the slice
  [r * mbs, (r + 1) * mbs). A global batch is therefore the next gbs indices whatever the data-parallel size,
  and a resumed run continues at consumed_samples. The last incomplete group is dropped unless drop_last=False.
- `MegatronPretrainingRandomSampler` (cyclic): one epoch per iteration over the sampler; the epoch is
  consumed_samples // (total - total % (mbs x dp)); indices come from `torch.randperm` seeded with the epoch,
  either per-rank buckets (data_sharding, Megatron's default) or one permutation dealt round-robin to ranks.
  Ours: `shuffle=False` (training.disable_shuffling) uses the identity instead of each permutation, so every
  epoch walks the same indices in order (per-rank buckets or round-robin alike).
"""
from __future__ import annotations

from typing import Iterator, List

import torch


def _check(total_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: {total_samples}")
    if micro_batch_size <= 0 or data_parallel_size <= 0:
        raise ValueError("micro_batch_size and data_parallel_size must be positive")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")


class MegatronPretrainingSampler:
    """Sequential batch sampler: yields this rank's micro-batches of dataset indices."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left to consume: {consumed_samples}, {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        start, end = self.get_start_end_idx()
        group = self.micro_batch_times_data_parallel_size
        first = self.consumed_samples
        full_end = first + (self.total_samples - first) // group * group
        for base in range(first, full_end, group):
            yield list(range(base + start, base + end))
        if full_end < self.total_samples and not self.drop_last:
            yield list(range(full_end, self.total_samples))[start:end]


class MegatronPretrainingRandomSampler:
    """Cyclic batch sampler: a fresh epoch-seeded permutation each time it is iterated."""

    def __init__(self, dataset, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True,
                 shuffle: bool = True) -> None:
        _check(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.shuffle = shuffle
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total = self.total_samples - self.last_batch_size
        if active_total <= 0:
            raise ValueError(f"{self.total_samples} samples cannot fill one micro-batch on every data-parallel rank "
                             f"({self.micro_batch_times_data_parallel_size})")
        self.epoch = self.consumed_samples // active_total
        epoch_consumed = self.consumed_samples % active_total
        assert epoch_consumed % self.micro_batch_times_data_parallel_size == 0
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = epoch_consumed // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = [start + x for x in self._permutation(bucket_size)[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            active = self._permutation(full_bucket_size)[epoch_consumed:]
            order = active[self.data_parallel_rank::self.data_parallel_size]
        batch: List[int] = []
        for idx in order:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []

    def _permutation(self, size: int) -> List[int]:
        """This epoch's order of range(size): torch.randperm seeded with the epoch, or in order without shuffle."""
        if not self.shuffle:
            return list(range(size))
        return torch.randperm(size, generator=torch.Generator().manual_seed(self.epoch)).tolist()
