"""Context parallel for the Gated DeltaNet (linear attention) layers of the `qwen3_next` model id.

A GDN layer is a recurrence along the whole sequence, so a cp rank holding a slice of the sequence cannot run it
alone. As Ulysses does for attention, one all_to_all turns the sequence-sharded inputs of the mixer (q, k, v
before the short conv, and the per-head b / a that make beta and the decay) into head-sharded ones over the whole
sequence: cp rank r gets key heads r*Hk/cp .. and the value heads that use them (grouped value heads stay
together when Hk is divisible by cp). The depthwise conv and the gated delta rule then run exactly as at cp 1
on those heads (`GatedDeltaNet.mix` with the matching rows of the conv weight, A_log and dt_bias), and a second
all_to_all returns the output to sequence shards; the projections and the gated norm stay per token, local.
Exact versus cp 1 (the same ops on the same values), unlike passing the chunk state from rank to rank, which
would serialise the ranks. Packed rows: the shards' position ids are gathered and the whole sequence's
documents give the `cu_seqlens`. Ring's head-tail layout is put back into sequence order after the gather.
Written here because torch has no sequence parallelism for linear attention; the all_to_all is Ulysses'.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2_backend.parallel.context_parallel.batch import sequence_indices
from fsdp2_backend.parallel.context_parallel.ulysses import heads_to_seq, seq_to_heads
from fsdp2_backend.config.tp_cp_checks import normalize_cp_type
from fsdp2_backend.kernels.varlen import cu_seqlens_from_position_ids, is_packed
from fsdp2_backend.usage_errors import UsageError

Tensor = torch.Tensor


class LinearAttentionContextParallel:
    """The `context_parallel` hook of a GDN layer: all_to_all to heads, the layer's `mix`, all_to_all back."""

    def __init__(self, group: dist.ProcessGroup, cp_type: str):
        self.group, self.cp_type = group, normalize_cp_type(cp_type)
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _order(self, length: int, device) -> Optional[Tensor]:
        """Sequence position of each gathered token (None when the gather is already in sequence order)."""
        if self.cp_type == "ulysses":
            return None
        return torch.cat([sequence_indices(length, r, self.size, self.cp_type, device=device)
                          for r in range(self.size)])

    def _to_heads(self, x: Tensor, inverse: Optional[Tensor]) -> Tensor:
        """[B, T/cp, h, d] → [B, T, h/cp, d] in sequence order."""
        out = seq_to_heads(x.transpose(1, 2), self.group).transpose(1, 2)
        return out if inverse is None else out.index_select(1, inverse)

    def _to_sequence(self, x: Tensor, order: Optional[Tensor]) -> Tensor:
        """[B, T, h/cp, d] in sequence order → this rank's [B, T/cp, h, d]."""
        return heads_to_seq(x if order is None else x.index_select(1, order), self.group)

    def _cu_seqlens(self, position_ids: Optional[Tensor], batch: int, inverse: Optional[Tensor]):
        if position_ids is None:
            return None
        shard = position_ids.expand(batch, -1).contiguous()
        pieces = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(pieces, shard, group=self.group)
        full = torch.cat(pieces, dim=1)
        if inverse is not None:
            full = full.index_select(1, inverse)
        return cu_seqlens_from_position_ids(full)[0] if is_packed(full) else None

    def __call__(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, b: Tensor, a: Tensor,
                 position_ids: Optional[Tensor]) -> Tensor:
        length = query.shape[1] * self.size
        order = self._order(length, query.device)
        inverse = None if order is None else torch.argsort(order)
        query, key, value = (self._to_heads(x, inverse) for x in (query, key, value))
        b, a = (self._to_heads(x.unsqueeze(-1), inverse).squeeze(-1) for x in (b, a))
        cu_seqlens = self._cu_seqlens(position_ids, query.shape[0], inverse)
        hk, hv = module.num_k_heads // self.size, module.num_v_heads // self.size
        out = module.mix(query, key, value, b, a, cu_seqlens, k_heads=slice(self.rank * hk, (self.rank + 1) * hk),
                         v_heads=slice(self.rank * hv, (self.rank + 1) * hv))
        return self._to_sequence(out, order)


def linear_attention_layers(model: nn.Module):
    """The GDN layers that take a context-parallel hook (the `qwen3_next` model id's `GatedDeltaNet`)."""
    return [m for m in model.modules() if hasattr(m, "context_parallel") and callable(getattr(m, "mix", None))]


def linear_attention_problems(model: nn.Module, cp: int) -> List[str]:
    """Why the GDN layers of `model` cannot be split over `cp` ranks (their key heads)."""
    heads = sorted({layer.num_k_heads for layer in linear_attention_layers(model) if layer.num_k_heads % cp})
    return [f"cp_size (--context-parallel-size): {cp} does not divide the {h} linear-attention key heads "
            "(linear_num_key_heads) — use a cp_size that divides it" for h in heads]


def enable_linear_attention_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, cp_type: str) -> int:
    """Installs the hook on every GDN layer of `model`; returns how many. Call with the attention CP stage."""
    layers = linear_attention_layers(model)
    problems = linear_attention_problems(model, cp_mesh.size())
    if problems:  # a run's model check reported them already (parallel.model_checks); a direct caller gets them here
        raise UsageError(problems)
    hook = LinearAttentionContextParallel(cp_mesh.get_group(), cp_type)
    for layer in layers:
        layer.context_parallel = hook
    return len(layers)
