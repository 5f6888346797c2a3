"""Megatron's pretraining samplers: the same global batches whatever the data-parallel size, resume at
consumed_samples, and the cyclic sampler's epoch-seeded permutations (checked against torch.randperm)."""
from __future__ import annotations

import pytest
import torch

from fsdp2_backend.data.sampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler


def _global_batches(total, consumed, mbs, dp, gbs):
    """Per iteration, every rank's micro-batches in (micro-step, rank) order, as Megatron's loop draws them."""
    iterators = [iter(MegatronPretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    batches = []
    while True:
        batch = []
        try:
            for _ in range(gbs // (mbs * dp)):
                for it in iterators:
                    batch.append(next(it))
        except StopIteration:
            return batches
        batches.append(batch)


@pytest.mark.parametrize("dp,mbs", [(1, 1), (1, 8), (2, 2), (2, 4), (4, 1)])
def test_global_batch_is_the_next_gbs_indices_whatever_dp(dp, mbs):
    batches = _global_batches(100, 0, mbs, dp, gbs=8)
    assert len(batches) == 12  # 96 samples in full global batches; the rest is dropped
    for k, batch in enumerate(batches):
        assert [i for micro in batch for i in micro] == list(range(8 * k, 8 * k + 8))


def test_dp1_and_dp2_see_the_same_samples_per_iteration():
    one = _global_batches(64, 0, 2, 1, gbs=8)
    two = _global_batches(64, 0, 2, 2, gbs=8)
    assert [sorted(sum(b, [])) for b in one] == [sorted(sum(b, [])) for b in two]


def test_resume_continues_at_consumed_samples():
    full = _global_batches(80, 0, 2, 2, gbs=8)
    resumed = _global_batches(80, 24, 2, 2, gbs=8)
    assert resumed == full[3:]


def test_partial_last_group_kept_without_drop_last():
    assert list(MegatronPretrainingSampler(10, 0, 2, 0, 2, drop_last=False)) == [[0, 1], [4, 5], [8, 9]]
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6, 7], []]


def test_sampler_rejects_exhausted_data():
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)


def test_cyclic_without_sharding_deals_one_permutation():
    total, mbs, dp = 23, 2, 2
    expected = torch.randperm((total // mbs) * mbs, generator=torch.Generator().manual_seed(0)).tolist()
    for rank in range(dp):
        sampler = MegatronPretrainingRandomSampler(None, total, 0, mbs, rank, dp, data_sharding=False)
        got = [i for b in sampler for i in b]
        mine = expected[rank::dp]
        assert got == mine[: len(mine) // mbs * mbs]


def test_cyclic_with_sharding_epochs_and_resume():
    total, mbs, dp = 40, 2, 2
    samplers = [MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp) for r in range(dp)]
    epoch0 = [[i for b in s for i in b] for s in samplers]
    assert sorted(epoch0[0] + epoch0[1]) == list(range(total))  # buckets [0, 20) and [20, 40)
    assert sorted(epoch0[1]) == list(range(20, 40))
    epoch1 = [[i for b in s for i in b] for s in samplers]  # consumed_samples advanced: epoch 1's seed
    assert epoch1 != epoch0 and sorted(epoch1[0]) == list(range(20))
    assert all(s.epoch == 1 and s.consumed_samples == 2 * total for s in samplers)
    resumed = MegatronPretrainingRandomSampler(None, total, total + 8, mbs, 0, dp)
    assert [i for b in resumed for i in b] == epoch1[0][4:]


@pytest.mark.parametrize("data_sharding", [True, False])
def test_cyclic_without_shuffle_walks_indices_in_order(data_sharding):
    total, mbs, dp = 23, 2, 2  # 20 usable samples per epoch
    samplers = [MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp, data_sharding=data_sharding,
                                                 shuffle=False) for r in range(dp)]
    for _ in range(2):  # every epoch the same order
        got = [[i for b in s for i in b] for s in samplers]
        if data_sharding:  # per-rank buckets [0, 10) and [10, 20), each in order
            assert got == [list(range(10)), list(range(10, 20))]
        else:  # 0, 1, ..., 21 dealt round-robin
            assert got == [list(range(0, 20, 2)), list(range(1, 20, 2))]
    resumed = MegatronPretrainingRandomSampler(None, total, 20 + 8, mbs, 0, dp, data_sharding=data_sharding,
                                               shuffle=False)
    assert [i for b in resumed for i in b] == got[0][4:]
