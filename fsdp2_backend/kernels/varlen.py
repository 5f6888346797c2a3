"""Packed sequences: the one convention for "several documents in one row" and its `cu_seqlens` form.

A packed batch is `[batch, seq]` tokens whose `position_ids` restart at 0 where each document starts (the
convention of Megatron's `--reset-position-ids`, of transformers' packed-sequence detection and of
LLaMA-Factory's `neat_packing`). Kernels that take variable-length input (flash-attention varlen, NPU TND
attention, chunked linear-attention / SSM scans) want instead the flattened boundaries `cu_seqlens`:
int32 offsets `[0, len_0, len_0+len_1, ..., batch*seq]` over the row-major flattened tokens, every row
boundary also being a document boundary. This module converts between the two; nothing else should.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(`cu_seqlens` int32 on the input's device, the longest document's length) for `[batch, seq]`
    `position_ids`: a document starts at every 0 and at the start of every row."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    batch, seq = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    flat_starts = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()
    total = torch.tensor([batch * seq], device=position_ids.device, dtype=flat_starts.dtype)
    cu = torch.cat([flat_starts, total]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return cu, max_len


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """The `[batch, seq]` position ids (restarting at each document) of flattened boundaries `cu_seqlens`."""
    total = batch * seq
    index = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].long()
    doc = torch.bucketize(index, starts, right=True) - 1
    return (index - starts[doc]).reshape(batch, seq)


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """`[batch, seq]` index of each token's document within its row (0, 1, ...): a document starts at every 0 and
    at the start of every row, as in `cu_seqlens_from_position_ids`. For masks over tokens that are not
    contiguous (ring attention's blocks): two tokens of a row attend only when their ids are equal."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.long().cumsum(dim=1)


def is_packed(position_ids: Optional[torch.Tensor]) -> bool:
    """True when some row of `position_ids` restarts at 0 after its first token (more than one document)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return False
    return bool((position_ids[:, 1:] == 0).any())
