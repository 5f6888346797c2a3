"""Time-based exit (Megatron's --exit-duration-in-mins): stop once training has run a number of minutes.

Owns `ExitTimer`. Megatron measures wall time from the start of `pretrain()` and, after each iteration (after
any interval checkpoint), all-reduces "time is up" with MAX over every rank, so that one slow clock or late
start stops all ranks at the same iteration; the loop then saves (unless it just did) and leaves. A rank that
decided alone would leave the others waiting in the next collective.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist


class ExitTimer:
    """`should_exit()` is True on every rank once any rank has run more than `minutes` since `start`.

    `minutes=None` never exits and never communicates (every rank has the same config, so all skip the
    collective together). `start` is a `time.time()` stamp (default: now); take it at the very start of the
    run, as Megatron does. `group` is the process group spanning every rank (None: the default group, when
    torch.distributed is initialised); `device` is where the flag tensor lives (the backend's device: cuda for
    nccl, npu for hccl, cpu for gloo).
    """

    def __init__(self, minutes: Optional[float], group=None, *, start: Optional[float] = None,
                 device: torch.device | str = "cpu"):
        self.minutes = minutes
        self.group, self.device = group, torch.device(device)
        self.start = time.time() if start is None else start

    def elapsed_minutes(self) -> float:
        """Minutes since `start` on this rank."""
        return (time.time() - self.start) / 60.0

    def should_exit(self) -> bool:
        """Whether to stop now; a collective over `group` (call it on every rank at the same point)."""
        if self.minutes is None:
            return False
        done = torch.tensor([int(self.elapsed_minutes() > self.minutes)], dtype=torch.int32, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.group)
        return bool(done.item())
