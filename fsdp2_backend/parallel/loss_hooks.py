"""The plan's one step for the model-side loss terms (`register_loss_hooks`, from `parallel.apply` after the model's
own switches installed them): each gets the sums over ranks it needs as functions, never process groups (model
code imports no torch.distributed), and its hooks on the optimizer step (`training.optimizer_step`), in this order:
the MoE routers' (`router_groups`: load-balancing sums, the expert-bias update and the MoE log values), then the
DSA indexer loss's (`models/dsa_indexer_loss.py`: before the micro-batches its backward scale, the lm loss's per
micro-batch, loss scale / (micro-batches x data-parallel ranks); after the step its log value, averaged over the
data-parallel x cp ranks).
"""
from __future__ import annotations

from torch import nn

from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.models.dsa_indexer_loss import finish_indexer_step, has_indexer_loss, set_backward_scale
from fsdp2_backend.parallel.router_groups import set_router_groups, sum_over
from fsdp2_backend.training.optimizer_step import step_hooks


def register_loss_hooks(model: nn.Module, ctx: ParallelContext, tokens_split_over_tp: bool = False) -> None:
    """The routers' reductions and hook (`tokens_split_over_tp`: expert parallel under tensor parallel), then the
    indexer loss's hooks when the model has one."""
    set_router_groups(model, ctx, tokens_split_over_tp)
    if not has_indexer_loss(model):
        return
    hooks, dp = step_hooks(model), ctx.loss_mesh.size()
    sum_batch = sum_over(ctx.loss_mesh.get_group())
    hooks.start["indexer_loss"] = lambda micro_batches, loss_scale: set_backward_scale(
        model, loss_scale / (micro_batches * dp))
    hooks.after_step["indexer_loss"] = lambda micro_batches: finish_indexer_step(model, sum_batch)
