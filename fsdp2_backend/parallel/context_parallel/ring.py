"""Ring attention: causal attention over a sequence split across the cp ranks, K/V blocks passed around.

Written here because torch's `context_parallel` has no CPU sharding rules. Layout contract (see `batch.py`):
the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r ("head-tail"), so every rank does
the same amount of causal work. With that layout, at ring step s rank r holds the K/V of rank src=(r-s) mod cp:
- s == 0: its own block, plain causal attention (its two chunks are in increasing position order);
- src < r: all local queries see the *first* chunk of src, not its second;
- src > r: only the local *second* chunk of queries sees src, and it sees both of src's chunks.
So no step needs a mask other than the diagonal one. Partial results merge by log-sum-exp.
Sliding windows (`window`: a query sees keys q - k < window, transformers' convention) add a mask from the
global positions of both blocks. Attention sinks (gpt_oss: one logit per head with a zero value) merge last, as
one more block with output 0 and lse = sink; the backward's formulas then hold unchanged for the keys (the sink
column adds nothing to out), and d sink = -Σ P_sink · (dout · out).
Packed documents (position ids restarting at 0 at each document, `kernels/varlen.py`): the shards' position ids
are gathered once per call and turned into document ids of the whole row; each block is then masked by
"same document and causal by global position" (ANDed with a window), and a block in which no query shares a
document with any key is skipped. The head-tail layout, hence the causal load balance, is unchanged.

The backward is a second ring pass (custom autograd.Function): K/V travel again together with their gradient
accumulators; after cp steps each accumulator has visited every rank and one last hop brings it home.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from fsdp2_backend.parallel.context_parallel.batch import OncePerTensor
from fsdp2_backend.parallel.context_parallel.blockwise import block_backward, block_forward, merge_into
from fsdp2_backend.kernels.varlen import document_ids_from_position_ids, is_packed

Tensor = torch.Tensor


def _ring_exchange(send: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sends `send` to the next cp rank and returns what the previous one sent (same shape)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return recv


def _step_slices(step: int, rank: int, size: int, half: int) -> Tuple[slice, slice, bool]:
    """(query rows, key rows, causal) that rank `rank` attends at ring step `step`; see the module docstring."""
    src = (rank - step) % size
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _positions(rank: int, size: int, half: int, device) -> Tensor:
    """Global positions of rank `rank`'s head-tail shard: chunks rank and 2*size-1-rank."""
    first = torch.arange(rank * half, (rank + 1) * half, device=device)
    return torch.cat([first, first + (2 * size - 1 - 2 * rank) * half])


def _block_mask(window, documents, step: int, rank: int, size: int, half: int, rows: slice, cols: slice, device):
    """Bool mask (True = attend) of one block: causal within `window` ([rows, cols]) and/or within the same
    document (`documents` [cp, b, 2c], each rank's document ids; mask [b, 1, rows, cols]); None without either."""
    if not window and documents is None:
        return None
    src = (rank - step) % size
    q_pos = _positions(rank, size, half, device)[rows]
    k_pos = _positions(src, size, half, device)[cols]
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window:
        mask = mask & (diff < window)
    if documents is not None:
        same = documents[rank][:, rows, None] == documents[src][:, None, cols]
        mask = (mask & same).unsqueeze(1)
    return mask


def _skipped(mask) -> bool:
    """A block no query of which may attend any of its keys (other documents only): nothing to compute."""
    return mask is not None and not bool(mask.any())


def _document_shards(position_ids, batch: int, group: dist.ProcessGroup, length: int):
    """[cp, b, 2c] document ids of every rank's head-tail shard from this rank's `position_ids` (gathered), or
    None when no row of the whole sequence holds more than one document (plain causal blocks then)."""
    if position_ids is None:
        return None
    rank_size = dist.get_world_size(group)
    shard = position_ids.expand(batch, -1).contiguous()
    pieces = [torch.empty_like(shard) for _ in range(rank_size)]
    dist.all_gather(pieces, shard, group=group)
    full = torch.empty(batch, length * rank_size, dtype=shard.dtype, device=shard.device)
    for r, piece in enumerate(pieces):
        full[:, _positions(r, rank_size, length // 2, shard.device)] = piece
    if not is_packed(full):
        return None
    documents = document_ids_from_position_ids(full)
    return torch.stack([documents[:, _positions(r, rank_size, length // 2, shard.device)]
                        for r in range(rank_size)])


def _sink_lse(sinks: Tensor, lse: Tensor) -> Tensor:
    return sinks.float().view(1, -1, 1).expand_as(lse)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, group: dist.ProcessGroup, sinks=None,
                window=None, documents=None):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            rows, cols, causal = _step_slices(step, rank, size, half)
            mask = _block_mask(window, documents, step, rank, size, half, rows, cols, q.device)
            if not _skipped(mask):
                block_out, block_lse = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                     causal and mask is None, scale, mask)
                merge_into(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            # The hop is synchronous (not overlapped with the block): simpler, and exactness does not depend on it.
            if step + 1 < size:
                kv = _ring_exchange(kv, group)
        if sinks is not None:  # the sink column: output 0, logit = sink
            merge_into(out, lse, torch.zeros_like(out), _sink_lse(sinks, lse))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks if sinks is not None else torch.empty(0))
        ctx.scale, ctx.group, ctx.window, ctx.has_sinks = scale, group, window, sinks is not None
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, scale, window = ctx.group, ctx.scale, ctx.window
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(size):
            rows, cols, causal = _step_slices(step, rank, size, half)
            mask = _block_mask(window, ctx.documents, step, rank, size, half, rows, cols, q.device)
            if not _skipped(mask):
                block_dq, block_dk, block_dv = block_backward(
                    dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                    lse[:, :, rows], causal and mask is None, scale, mask)
                dq[:, :, rows] += block_dq.float()
                dkv[0][:, :, cols] += block_dk.float()
                dkv[1][:, :, cols] += block_dv.float()
            # K/V go on to the next rank with their gradient so far; after the last step only the gradient
            # travels, and that hop brings it back to the rank that owns the block.
            if step + 1 < size:
                kv, dkv = _exchange_pair(kv, dkv, group)
            else:
                dkv = _ring_exchange(dkv, group)
        dsinks = None
        if ctx.has_sinks:  # d sink = -Σ P_sink (dout · out), over batch and rows
            delta = (dout.float() * out.float()).sum(-1)
            dsinks = -(torch.exp(_sink_lse(sinks, lse) - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, dsinks, None, None


def _exchange_pair(kv: Tensor, dkv: Tensor, group: dist.ProcessGroup) -> Tuple[Tensor, Tensor]:
    """One ring hop for K/V and their fp32 gradient accumulator together."""
    flat: List[Tensor] = [kv.float().reshape(-1), dkv.reshape(-1)]
    received = _ring_exchange(torch.cat(flat), group)
    kv_part, dkv_part = received.split([kv.numel(), dkv.numel()])
    return kv_part.view(kv.shape).to(kv.dtype), dkv_part.view(dkv.shape)


_DOCUMENTS = OncePerTensor()  # the document ids of every shard, gathered once per forward (not once per layer)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, group: dist.ProcessGroup, sinks=None,
                   window=None, position_ids=None) -> Tensor:
    """Causal attention of this rank's head-tail shard; q [b, h, 2c, d], k/v [b, hkv, 2c, d] → [b, h, 2c, d];
    `sinks` [h] (this rank's heads), `window` (sliding window: keys q - k < window), `position_ids` [b or 1, 2c]
    this shard's (restarting at each packed document: attention stays within documents). Every cp rank must
    pass position ids or none (they are gathered)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {q.shape[2]}")
    documents = None if position_ids is None else _DOCUMENTS(
        position_ids, (id(group), q.shape[0], q.shape[2]),
        lambda: _document_shards(position_ids, q.shape[0], group, q.shape[2]))
    return _RingAttention.apply(q, k, v, scale, group, sinks, window, documents)
