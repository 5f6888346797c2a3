"""The sizes of every parallel dimension for a world size (`ParallelLayout`), derived once from the validated
`parallel` group. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from fsdp2_backend.config.schema import ParallelArguments


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of every parallel dimension for a world size, derived once from the config."""

    world_size: int
    tp: int
    cp: int
    dp: int            # data-parallel ranks = world / (tp x cp)
    dp_shard: int      # FSDP shard group size
    dp_replicate: int  # HSDP replicas = dp / dp_shard
    ep: int
    ep_fsdp: int


def fsdp_shard_size(fsdp_size: int, world_size: int, dp: int, cp: int) -> int:
    """The data-parallel ranks one FSDP group shards over, from `fsdp_size` as MindSpeed counts it: the ranks
    sharding the parameters, context-parallel ranks inside (fsdp 8 with cp 2 on 8 ranks is 4 data-parallel
    shards); 1, or the whole world, means every data-parallel rank. 0 when it fits no layout (validation says
    why)."""
    if fsdp_size <= 1 or fsdp_size == world_size or fsdp_size == dp * cp:
        return dp
    if fsdp_size % cp or dp % (fsdp_size // cp):
        return 0
    return fsdp_size // cp


def parallel_layout(parallel: ParallelArguments, world_size: int) -> ParallelLayout:
    """Sizes for `world_size`; assumes `config_validation` accepted them."""
    tp, cp = parallel.tp_size, parallel.cp_size
    dp = max(world_size // (tp * cp), 1)
    dp_shard = fsdp_shard_size(parallel.fsdp_size, world_size, dp, cp)
    return ParallelLayout(world_size=world_size, tp=tp, cp=cp, dp=dp, dp_shard=dp_shard,
                          dp_replicate=max(dp // max(dp_shard, 1), 1), ep=parallel.ep_size, ep_fsdp=parallel.ep_fsdp_size)
