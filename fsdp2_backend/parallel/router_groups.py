"""Hands the MoE routers (`models/moe/router.py`) the process groups their load-balancing losses reduce over.

Model code holds no process groups; megatron-core's router sums the token counts of `aux_loss` /
`seq_aux_loss` over the tensor-and-context-parallel group and those of `global_aux_loss` over the
tensor-data-and-context-parallel group. Here tensor-parallel ranks see the same tokens (the router is
replicated), so `sequence_group` is the context-parallel group (unset at cp 1) and `token_group` the dp x cp
group whose tokens make one global batch (the loss group; unset when it is one rank).
With expert parallel under tensor parallel the MoE blocks run on each tp rank's own tokens
(`moe_tensor_parallel`): then the tp ranks join both groups (tp x cp, and every rank), and `tp_split` tells the
router that tp of its sequence shards are not context-parallel (their gradients are summed, not averaged).
"""
from __future__ import annotations

from torch import nn

from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.models.moe.router import routers


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
    for router in found:
        router.sequence_group, router.token_group, router.tp_split = sequence, tokens, tp_split
