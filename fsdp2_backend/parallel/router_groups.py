"""Hands the MoE routers (`models/moe/router.py`) the process groups their load-balancing losses reduce over.

Model code holds no process groups; megatron-core's router sums the token counts of `aux_loss` /
`seq_aux_loss` over the tensor-and-context-parallel group and those of `global_aux_loss` over the
tensor-data-and-context-parallel group. Here tensor-parallel ranks see the same tokens (the router is
replicated), so `sequence_group` is the context-parallel group (unset at cp 1) and `token_group` the dp x cp
group whose tokens make one global batch (the loss group; unset when it is one rank).
"""
from __future__ import annotations

from torch import nn

from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.models.moe.router import routers


def set_router_groups(model: nn.Module, ctx: ParallelContext) -> None:
    found = list(routers(model))
    if not found:
        return
    sequence = ctx.cp_mesh.get_group() if ctx.cp_mesh.size() > 1 else None
    tokens = ctx.loss_mesh.get_group() if ctx.loss_mesh.size() > 1 else None
    for router in found:
        router.sequence_group, router.token_group = sequence, tokens
