"""The one DTensor unwrap: `local_tensor(t)` is this rank's shard of a DTensor, or `t` itself.

FSDP2, TP and EP parameters (and their gradients) are DTensors; code that works on the local data — in-place
gradient scaling, norm sums, expert matmuls — goes through this function instead of its own
`to_local()` check, so plain tensors and DTensors are told apart in one way everywhere.

The two other unwraps model code needs, so that it imports no torch.distributed (the layer test checks): writing
a whole tensor into a possibly sharded one (`write_whole`: no communication) and a module's own class under the
subclass FSDP2 swaps in (`own_class`).
"""
from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

T = TypeVar("T")


def local_tensor(t: T) -> T:
    """`t.to_local()` for a DTensor (a view: in-place ops on it change the DTensor's shard), else `t` unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


def write_whole(target: torch.Tensor, full: torch.Tensor) -> None:
    """Writes `full` (the whole tensor, the same on every rank) into `target`: a DTensor keeps its own shard, sliced
    locally (`src_data_rank=None`: no communication); a plain tensor takes all of it."""
    if isinstance(target, DTensor):
        local = local_tensor(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None))
        local_tensor(target).copy_(local)
    else:
        target.copy_(full)


def own_class(module: nn.Module) -> type:
    """`module`'s class without the subclass FSDP2's `fully_shard` swaps in (its own class when not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
