"""Hands the MoE routers (`models/moe/router.py`) the sums over ranks their load-balancing losses and expert
biases need, as functions (`RouterReductions`: model code sees no process group), and registers their after-step
hook on the optimizer step (`training.optimizer_step`). `sum_over(group)` turns a group into such a function.

Megatron-core's router sums the token counts of `aux_loss` / `seq_aux_loss` over the tensor-and-context-parallel
group and those of `global_aux_loss` over the tensor-data-and-context-parallel group. Here tensor-parallel ranks
see the same tokens (the router is replicated), so `sum_sequence` runs over the context-parallel group (this rank
alone at cp 1) and `sum_batch` over the dp x cp group whose tokens make one global batch (the loss group; this rank
alone when it is one rank). With expert parallel under tensor parallel the MoE blocks run on each tp rank's own
tokens (`moe_tensor_parallel`): then the tp ranks join both groups (tp x cp, and every rank), and `tp_split` tells
the router that tp of its sequence shards are not context-parallel (their gradients are summed, not averaged).
The expert-bias token counts are summed over every rank (`sum_all`), after each step (`finish_router_step`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.models.moe.router import RouterReductions, finish_router_step, routers
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


def _ranks(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def set_router_groups(model: nn.Module, ctx: ParallelContext, tokens_split_over_tp: bool = False) -> None:
    found = list(routers(model))
    if not found:
        return
    sequence = ctx.cp_mesh.get_group() if ctx.cp_mesh.size() > 1 else None
    tokens = ctx.loss_mesh.get_group() if ctx.loss_mesh.size() > 1 else None
    tp_split = ctx.tp_mesh.size() if tokens_split_over_tp else 1
    if tp_split > 1:
        sequence = ctx.world_mesh["cp", "tp"]._flatten("cp_tp").get_group()
        tokens = ctx.world_mesh._flatten("dp_cp_tp").get_group()
    reductions = RouterReductions(sum_sequence=sum_over(sequence), sequence_ranks=_ranks(sequence),
                                  sum_batch=sum_over(tokens), batch_ranks=_ranks(tokens),
                                  sum_all=sum_over(dist.group.WORLD), tp_split=tp_split)
    for router in found:
        router.reductions = reductions
    step_hooks(model).after_step["routers"] = lambda micro_batches: finish_router_step(model, micro_batches)
