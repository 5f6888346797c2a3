"""The per-parameter step loop the project's own optimizers share (`ShardedMuon`, `MegatronMuon`,
`BF16StateAdamW`): the closure, the parameters that have a gradient with their group and state, Muon's momentum,
and an orthogonalisation that sees the whole matrix of an FSDP2 / TP DTensor.

Written once so that the three optimizers differ only in their update rule.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor, distribute_tensor


def run_closure(closure: Optional[Callable[[], torch.Tensor]]) -> Optional[torch.Tensor]:
    """torch's optimizer contract: the closure re-evaluates the loss with gradients enabled; None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grad(optimizer: torch.optim.Optimizer) -> Iterator[Tuple[dict, torch.Tensor, dict]]:
    """(param group, parameter, its state) for every parameter that has a gradient, in param-group order."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p, optimizer.state[p]


def momentum_update(p: torch.Tensor, state: dict, momentum: float, nesterov: bool) -> torch.Tensor:
    """Muon's momentum: the buffer m <- momentum m + (1 - momentum) g (created as zeros); the update is m, or with
    Nesterov g + momentum (m - g)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    buf.lerp_(p.grad, 1 - momentum)
    return p.grad.lerp(buf, momentum) if nesterov else buf


def on_full_matrix(update: torch.Tensor, orthogonalise: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`orthogonalise(update)`, on the whole matrix when `update` is a DTensor: gathered once (`full_tensor`),
    computed identically on every rank, and this rank's shard kept without communicating."""
    if not isinstance(update, DTensor):
        return orthogonalise(update)
    full = orthogonalise(update.full_tensor()).to(update.dtype)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
