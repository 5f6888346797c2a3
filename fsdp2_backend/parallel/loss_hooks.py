"""What the plan hands the model-side loss terms: sums over ranks as functions (`sum_over`), never process groups
(model code imports no torch.distributed), and the DSA indexer loss's optimizer-step hooks
(`register_indexer_hooks`; the MoE routers' are `router_groups`'s, which calls this after its own, so the step runs
the routers' hook first). The indexer loss (`models/dsa_indexer_loss.py`): before the micro-batches its backward
scale, the lm loss's per micro-batch (loss scale / (micro-batches x data-parallel ranks)); after the step its log
value, averaged over the data-parallel x cp ranks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.models.dsa_indexer_loss import finish_indexer_step, has_indexer_loss, set_backward_scale
from fsdp2_backend.training.optimizer_step import step_hooks


def sum_over(group: Optional[dist.ProcessGroup]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that sums a tensor over `group` in place and returns it; the identity for no group or one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return _same
    return lambda tensor: _all_reduce(tensor, group)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


def register_indexer_hooks(model: nn.Module, ctx: ParallelContext) -> None:
    """Registers the indexer loss's hooks when the model's own switches installed one (nothing otherwise)."""
    if not has_indexer_loss(model):
        return
    hooks, dp = step_hooks(model), ctx.loss_mesh.size()
    sum_batch = sum_over(ctx.loss_mesh.get_group())
    hooks.start["indexer_loss"] = lambda micro_batches, loss_scale: set_backward_scale(
        model, loss_scale / (micro_batches * dp))
    hooks.after_step["indexer_loss"] = lambda micro_batches: finish_indexer_step(model, sum_batch)
