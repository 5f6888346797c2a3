"""Ulysses (DeepSpeed-style) context parallel: all_to_all from sequence-sharded to head-sharded and back.

Each cp rank holds a contiguous slice of the sequence with all (tensor-parallel-local) heads. One all_to_all
gives every rank the whole sequence for heads/cp heads; any ordinary causal attention runs on that; a second
all_to_all returns the output to sequence shards. Key/value heads fewer than cp (GQA) are repeated so that each
rank gets the one key/value head its query heads use. Written here because torch has no Ulysses.
The all_to_all is a small autograd.Function (torch's autograd wrapper of it is deprecated).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class _AllToAll(torch.autograd.Function):
    """Even all_to_all over dim 0; its gradient is the same all_to_all applied to the output gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()  # first: empty_like keeps strides, and the collective writes a dense buffer
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def _all_to_all_dim0(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _AllToAll.apply(x, group)


def seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[b, h, s/cp, d] sequence shard → [b, h/cp, s, d] head shard (sequence in cp-rank order)."""
    cp = dist.get_world_size(group)
    b, h, s_local, d = x.shape
    if h % cp:
        raise ValueError(f"Ulysses: {h} heads on this rank are not divisible by cp_size={cp}")
    # Chunk j of the head dim goes to cp rank j; what comes back, indexed by source rank, is sequence order.
    send = x.reshape(b, cp, h // cp, s_local, d).transpose(0, 1)
    received = _all_to_all_dim0(send, group)  # [cp(source = sequence slice), b, h/cp, s/cp, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_local, d)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[b, s, h/cp, d] head shard (HF attention output layout) → [b, s/cp, h, d] sequence shard."""
    cp = dist.get_world_size(group)
    b, s, h_local, d = x.shape
    send = x.reshape(b, cp, s // cp, h_local, d).transpose(0, 1)
    received = _all_to_all_dim0(send, group)  # [cp(source = head group), b, s/cp, h/cp, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * h_local, d)


def replicate_kv_heads(x: Tensor, cp: int) -> Tensor:
    """Repeats key/value heads so their count is a multiple of cp (needed when there are fewer than cp).

    Head j of the result is original head j // (cp / hkv): after the all_to_all rank r holds original head
    r * hkv // cp, the one that its query heads r*h/cp .. (r+1)*h/cp - 1 use.
    """
    kv_heads = x.shape[1]
    if kv_heads % cp == 0:
        return x
    if cp % kv_heads:
        raise ValueError(f"Ulysses: {kv_heads} key/value heads neither divide nor are divisible by cp_size={cp}")
    return x.repeat_interleave(cp // kv_heads, dim=1)
