"""The one DTensor unwrap: `local_tensor(t)` is this rank's shard of a DTensor, or `t` itself.

FSDP2, TP and EP parameters (and their gradients) are DTensors; code that works on the local data — in-place
gradient scaling, norm sums, expert matmuls — goes through this function instead of its own
`to_local()` check, so plain tensors and DTensors are told apart in one way everywhere.
"""
from __future__ import annotations

from typing import TypeVar

from torch.distributed.tensor import DTensor

T = TypeVar("T")


def local_tensor(t: T) -> T:
    """`t.to_local()` for a DTensor (a view: in-place ops on it change the DTensor's shard), else `t` unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t
