"""Splitting a batch along the sequence for context parallel, and the token-mean loss over the cp group.

Layouts: Ulysses gives cp rank r the contiguous slice r of cp slices. Ring cuts the sequence into 2*cp chunks
and gives rank r chunks r and 2*cp-1-r (head-tail), which balances causal work (early chunks attend little,
late chunks a lot). Every per-token tensor (input_ids, labels, position_ids, loss_mask) is cut the same way,
and position_ids are made explicit so RoPE sees each token's true position on every shard.

Labels must already be aligned with the inputs (Megatron style: labels[t] is the token after input t), because
a shard cannot shift its own labels: the next token of its last position lives on another rank. With HF-style
labels call `shift_labels` first, and compute the loss from logits per token (not with a model's internal
shifting loss).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.config.tp_cp_checks import normalize_cp_type, sequence_length_problems

Tensor = torch.Tensor
PER_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "loss_mask")
_PACKING_KEYS = ("actual_seq_len", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")


class OncePerTensor:
    """A one-entry memo keyed by tensor identity: every attention layer of one forward receives the same
    `position_ids` tensor, so what is gathered from it over the cp group (the whole sequence's positions,
    Ulysses; the document ids of every shard, ring) is computed by the first layer and reused by the others and by
    recomputation — one collective per micro-batch, not one per layer. Every cp rank calls in the same pattern
    (the same code path with its own tensor), so hits and misses agree across ranks."""

    def __init__(self):
        self._key: Optional[Tensor] = None  # held, so its identity cannot be reused while it is the key
        self._context: tuple = ()
        self._value = None

    def __call__(self, key: Tensor, context: tuple, compute: Callable[[], object]):
        """`compute()`, or its value from the last call with this very tensor and an equal `context` (the group,
        the shapes: whatever else the value depends on)."""
        if key is not self._key or context != self._context:
            self._key, self._context, self._value = key, context, compute()
        return self._value


def sequence_indices(seq_len: int, cp_rank: int, cp_size: int, cp_type: str, device=None) -> Tensor:
    """Positions (in the full sequence) of the tokens that cp rank `cp_rank` holds, in local order."""
    cp_type = normalize_cp_type(cp_type)
    if cp_type == "ulysses":
        step = seq_len // cp_size
        return torch.arange(cp_rank * step, (cp_rank + 1) * step, device=device)
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def shift_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """HF-style labels (equal to input_ids) → aligned labels (next token), last position ignored."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def _check_unpacked(batch: Dict[str, Tensor]) -> None:
    """Packed rows whose documents are marked by restarting position_ids (`kernels/varlen.py`) pass: both
    algorithms read the documents from the position ids of the whole sequence (Ulysses gathers them for its
    attention, ring masks its blocks by them). Other descriptions of documents or padding are declined."""
    present = [key for key in _PACKING_KEYS if batch.get(key) is not None]
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        present.append("attention_mask with padding")
    if present:
        raise UsageError(f"context parallel: packed or padded sequences ({', '.join(present)}) are not supported "
                         "with cp_size > 1 — mark documents by restarting position ids (--reset-position-ids, "
                         "data.neat_packing), or use cp_size 1")


def shard_batch_for_cp(batch: Dict[str, Tensor], cp_rank: int, cp_size: int, cp_type: str,
                       seq_dim: int = 1) -> Dict[str, Tensor]:
    """This cp rank's part of a [batch, seq] batch: per-token tensors cut along `seq_dim`, position_ids added.

    An all-ones `attention_mask` is dropped (the CP attention is causal by construction); packed documents travel
    as restarting position_ids, cut like every per-token tensor; anything else describing padding or documents is
    declined with a UsageError. Other keys pass through unchanged.
    """
    if cp_size <= 1:
        return dict(batch)
    seq_len = batch["input_ids"].shape[seq_dim]
    problems = sequence_length_problems(seq_len, cp_size, cp_type)
    if problems:
        raise UsageError(problems)
    _check_unpacked(batch)
    out = {key: value for key, value in batch.items() if key not in PER_TOKEN_KEYS + ("attention_mask",)}
    index = sequence_indices(seq_len, cp_rank, cp_size, cp_type, device=batch["input_ids"].device)
    full = dict(batch)
    if full.get("position_ids") is None:
        full["position_ids"] = torch.arange(seq_len, device=index.device).expand_as(batch["input_ids"])
    for key in PER_TOKEN_KEYS:
        if full.get(key) is not None:
            out[key] = full[key].index_select(seq_dim, index)
    return out


def cp_token_mean(loss_sum: Tensor, token_count: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Loss to back-propagate on this rank: local sum of token losses / tokens counted over the whole group.

    Summing the result over the group gives the true mean (and summing the ranks' gradients gives the true
    gradient). `token_count` is all-reduced (no gradient); `loss_sum` is not, so pass the group that shares a
    sequence (cp, or dp x cp flattened). The *reported* loss is this value all-reduced with SUM over the group.
    """
    count = token_count.detach().clone().float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return loss_sum / count.clamp(min=1)
