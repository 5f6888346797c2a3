"""Megatron's --exit-signal-handler: on a signal (SIGTERM by default: a scheduler's preemption), save a checkpoint
at the next iteration boundary and exit.

Owns the handler and the decision. `install(name)` replaces the signal's handler in the main thread with one that
only records the signal (a signal is process-wide, so the record is this module's; nothing else keeps state here).
Installed before the data loader starts its worker processes, forked workers inherit it and survive a signal sent
to the whole process tree (as SLURM and `kill -- -PGID` do). `ExitSignal.should_exit()` is called by the training
loop after each iteration on every rank: an all-reduce (MAX) of "received", as Megatron's
DistributedSignalHandler all-gathers it, so that every rank saves and leaves at the same iteration even when only
some received the signal. Torch is imported only by that method.
"""
from __future__ import annotations

import signal
from typing import Set

from fsdp2_backend.config.signal_names import resolve_signal

_received: Set[int] = set()
_installed: Set[int] = set()


def _record(signum, frame) -> None:  # noqa: ARG001 — the signal module's signature
    _received.add(signum)


def install(name: str) -> signal.Signals:
    """Records `name` instead of dying of it, from now on (main thread only; idempotent)."""
    sig = resolve_signal(name)
    if sig is None:
        raise ValueError(f"unknown signal {name!r}")
    if sig not in _installed:
        signal.signal(sig, _record)
        _installed.add(sig)
    return sig


def received(sig: signal.Signals) -> bool:
    return int(sig) in _received


class ExitSignal:
    """`should_exit()` is True on every rank once any rank has received the signal (a collective when enabled).

    Disabled (`enabled=False`) it never communicates: every rank has the same config, so all skip together."""

    def __init__(self, enabled: bool, name: str = "SIGTERM", group=None, device="cpu"):
        self.enabled, self.group, self.device = enabled, group, device
        self.signal = install(name) if enabled else None

    def should_exit(self) -> bool:
        if not self.enabled:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(received(self.signal))], dtype=torch.int32, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
