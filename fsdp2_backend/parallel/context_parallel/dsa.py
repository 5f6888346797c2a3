"""Context parallel for the DeepSeek-sparse-attention (DSA) model ids, `deepseek_v4` and `glm52`: MindSpeed-LLM's
`cp_type: kvallgather`.

A DSA layer picks each query's keys from its whole causal prefix (the lightning indexer's top-k; DeepSeek-V4 also
compresses the keys in windows of the sequence), so neither Ulysses (which hands the inner attention a head slice
of the whole sequence but not the indexer) nor ring (which never holds every key at once) can run it. Here each cp
rank keeps its own queries (the layout `batch.shard_batch_for_cp` gave them) and all-gathers, with gradient, what
the keys are made from; the per-model modules (`dsa_deepseek_v4.py`, `dsa_glm.py`) replace the attention
module's forward with one that computes the same values as transformers' at cp 1 for this rank's queries.

`enable_dsa_context_parallel` is the one entry point (`parallel/apply.py`): it returns True when it made the model
context parallel, and the generic attention CP is then not applied. `SequenceLayout` is what both models share: the
gather into sequence order and the global positions of this rank's tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from fsdp2_backend.config.tp_cp_checks import normalize_cp_type
from fsdp2_backend.kernels.varlen import is_packed
from fsdp2_backend.models.registry import spec_for_model_type
from fsdp2_backend.parallel.context_parallel.batch import OncePerTensor, sequence_indices
from fsdp2_backend.usage_errors import UsageError

Tensor = torch.Tensor


class SequenceLayout:
    """The cp group and where its ranks' tokens lie in the whole sequence (`batch.shard_batch_for_cp`'s layout for
    `cp_type`: ring's head-tail chunks, Ulysses' contiguous slices); one per model, shared by its layers."""

    def __init__(self, group: dist.ProcessGroup, cp_type: str, model_id: str):
        self.group, self.cp_type, self.model_id = group, normalize_cp_type(cp_type), model_id
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._packed = OncePerTensor()  # the packing check: one gather of the position ids per forward

    def positions(self, local_length: int, device) -> Tensor:
        """The sequence positions of this rank's `local_length` tokens, in local order."""
        return sequence_indices(local_length * self.size, self.rank, self.size, self.cp_type, device=device)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's shard of `x` along the sequence dimension `dim`, in sequence order, with gradient (its
        backward sums each shard's gradient over the ranks and returns this rank's)."""
        # not torch.distributed.nn.functional.all_gather (deprecated for this one): on gloo its backward's
        # all_to_all returns wrong gradients when the output's gradient is not contiguous (a transposed matmul's)
        whole = all_gather_single_autograd(x.contiguous(), dim, self.group)
        if self.cp_type == "ulysses":  # rank-major is sequence order
            return whole
        order = torch.cat([sequence_indices(whole.shape[dim], r, self.size, self.cp_type, device=x.device)
                           for r in range(self.size)])
        return whole.index_select(dim, torch.argsort(order))

    def check_unpacked(self, position_ids: Optional[Tensor], batch: int) -> None:
        """Declines packed documents: the whole sequence's position ids (gathered once per forward) restart."""
        if position_ids is None:
            return
        shard = position_ids.expand(batch, -1)
        packed = self._packed(position_ids, (id(self.group), tuple(shard.shape)),
                              lambda: is_packed(self.gather(shard.detach(), dim=1)))
        if packed:
            raise UsageError(f"context parallel (cp_size > 1) for model_id {self.model_id}: packed documents "
                             "(restarting position ids: reset_position_ids, neat_packing) are not supported — train "
                             "on unpacked sequences, or use cp_size 1")


def _own_hook(model: nn.Module) -> Optional[str]:
    """The model's own context parallel, "module:function" of this package: the `cp_hook` of the spec that
    builds the config's model_type (models/<id>/spec.py: deepseek_v4, glm52), or None."""
    spec = spec_for_model_type(getattr(model.config, "model_type", None))
    return spec.cp_hook if spec is not None else None


def dsa_context_parallel(model: nn.Module) -> bool:
    """True when `model`'s attention is DSA, made context parallel by `enable_dsa_context_parallel`."""
    return _own_hook(model) is not None


def enable_dsa_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, cp_type: str) -> bool:
    """Makes every DSA attention of `model` context parallel over `cp_mesh` (1-D); False for other models (read
    from the config's model_type: no DSA model code is imported for them)."""
    import importlib

    hook = _own_hook(model)
    if hook is None:
        return False
    module, function = hook.split(":")
    getattr(importlib.import_module(f"fsdp2_backend.parallel.context_parallel.{module}"), function)(model, cp_mesh,
                                                                                                      cp_type)
    return True
