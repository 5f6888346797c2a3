"""Megatron's language-model loss: per-micro-batch masked sums, their scaling for backward, and the reported loss.

Megatron's loss function returns, per micro-batch, the SUM of token losses times the loss mask and the number
of unmasked tokens. Without `calculate_per_token_loss`, backward runs on sum / max(tokens, 1) / num_microbatches
and gradients are averaged over data-parallel ranks; with it, backward runs on the plain sum and gradients are
divided by the token count of the whole global batch after the reduction. The reported `lm loss` is always
token-weighted over the global batch.

Every cross-rank reduction here is an explicit all_reduce(SUM) followed by a division: FSDP2's AVG reduction
can sum instead of average on gloo (pytorch#162338), so FSDP reduces with a plain SUM — the gradient policy that
`parallel.apply.set_gradient_policy` sets on every FSDP module — and the 1/dp of Megatron's averaging is folded
into the backward loss by `GlobalBatchLoss.backward_loss`, the one loss normaliser (dp, cp, per-token and MoE
aux-loss scaling).

Labels are already shifted (Megatron's `labels[i] = tokens[i + 1]`), so logits[:, i] scores labels[:, i].
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from fsdp2_backend.distributed.dtensor import local_tensor


def masked_loss_sum(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(sum of cross entropy × loss_mask, number of unmasked tokens), both fp32 scalars.

    logits [..., V] aligned with labels [...]; loss_mask has labels' shape (0/1 or bool).
    """
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), reduction="none")
    mask = loss_mask.reshape(-1).float()
    return (losses * mask).sum(), mask.sum()


def chunked_masked_loss_sum(hidden: Tensor, lm_head: Callable[[Tensor], Tensor], labels: Tensor,
                            loss_mask: Tensor, chunk_size: int) -> Tuple[Tensor, Tensor]:
    """`masked_loss_sum` computed `chunk_size` tokens at a time from the final hidden states (`chunk_loss_size`).

    `lm_head` maps hidden [n, H] to logits [n, V] (the model's output layer). Each chunk's logits are recomputed
    in backward (non-reentrant checkpoint), so at most one chunk of logits lives at a time; the loss and the
    gradients equal the unchunked computation up to summation order. Under FSDP2, call it inside the root
    module's forward (a wrapper whose forward runs the backbone, then this), so every unit is unsharded when
    called; the lm head may be its own FSDP unit (called once per chunk; tested against 1 rank in
    tests/training/test_grad_clip.py).
    """
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_labels, flat_mask = labels.reshape(-1), loss_mask.reshape(-1)

    def chunk_sum(h: Tensor, y: Tensor, m: Tensor) -> Tensor:
        return (F.cross_entropy(lm_head(h).float(), y, reduction="none") * m.float()).sum()

    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.size(0), chunk_size):
        end = start + chunk_size
        total = total + checkpoint(chunk_sum, flat_hidden[start:end], flat_labels[start:end],
                                   flat_mask[start:end], use_reentrant=False)
    return total, flat_mask.float().sum()


class GlobalBatchLoss:
    """One global batch's loss bookkeeping: the backward scaling of each micro-batch and the reported lm loss.

    Call `backward_loss(sum, tokens)` per micro-batch and `.backward()` the result; after the last backward
    (FSDP has reduce-scattered gradients with a SUM), call `finish(parameters)`: it all-reduces the summed
    losses and token counts over `dp_group`, applies the per-token gradient scaling when
    `calculate_per_token_loss`, and returns the token-weighted global lm loss (a Python float; nan if
    non-finite, which the trainer counts as a nan iteration). `dp_group` is the data-parallel group (with
    context parallel later: the dp×cp group); None with dp_size > 1 means the default (world) group.
    """

    def __init__(self, *, num_microbatches: int, dp_size: int, calculate_per_token_loss: bool,
                 dp_group: Optional[dist.ProcessGroup] = None, cp_size: int = 1,
                 cp_group: Optional[dist.ProcessGroup] = None):
        self.num_microbatches, self.dp_size = num_microbatches, dp_size
        self.per_token = calculate_per_token_loss
        self.dp_group = dp_group
        self.cp_size, self.cp_group = cp_size, cp_group
        self._loss_sum: Optional[Tensor] = None
        self._tokens: Optional[Tensor] = None

    def backward_loss(self, loss_sum: Tensor, num_tokens: Tensor, aux_loss: Optional[Tensor] = None) -> Tensor:
        """The scalar to call `.backward()` on for this micro-batch (also records it for the report).

        Context parallel: this rank holds part of the sequence, and the micro-batch's mean runs over the whole
        sequence: the rank's share is its tokens over all cp ranks' tokens, times cp (the 1/(dp x cp) below
        and the SUM over the sequence's ranks make it whole). `aux_loss` (MoE load balancing, already weighted)
        joins the backward loss averaged like the lm loss, as Megatron adds it; it is not reported."""
        scaled = self._lm_backward_loss(loss_sum, num_tokens)
        if self.cp_size > 1 and not self.per_token:
            total = num_tokens.detach().float().clone()
            dist.all_reduce(total, group=self.cp_group)
            scaled = scaled * (num_tokens.detach().float() * self.cp_size / total.clamp(min=1))
        if aux_loss is not None:
            scaled = scaled + aux_loss / (self.num_microbatches * self.dp_size)
        return scaled

    def extra_backward_loss(self, loss_sums, counts, weight: float) -> Tensor:
        """MTP (models/mtp.py): weight x sum_k of each depth's (sum, count) normalised exactly as the lm loss
        (per-token: plain sums; else per-micro-batch means over the whole sequence under cp, / micro-batches / dp).
        Not recorded in the reported lm loss."""
        total = loss_sums[0].new_zeros(())
        for loss_sum, count in zip(loss_sums, counts):
            if self.per_token:
                total = total + loss_sum
                continue
            whole = count.detach().float().clone()
            if self.cp_size > 1:
                dist.all_reduce(whole, group=self.cp_group)
            total = total + loss_sum / whole.clamp(min=1) / (self.num_microbatches * self.dp_size) * self.cp_size
        return total * weight

    def _lm_backward_loss(self, loss_sum: Tensor, num_tokens: Tensor) -> Tensor:
        detached = torch.stack([loss_sum.detach().float(), num_tokens.detach().float()])
        if self._loss_sum is None:
            self._loss_sum, self._tokens = detached[0].clone(), detached[1].clone()
        else:
            self._loss_sum += detached[0]
            self._tokens += detached[1]
        if self.per_token:
            return loss_sum
        # Megatron: mean over this micro-batch's tokens, averaged over micro-batches and (via 1/dp with a SUM
        # reduction) over data-parallel ranks.
        return loss_sum / num_tokens.clamp(min=1) / (self.num_microbatches * self.dp_size)

    def finish(self, parameters: Iterable[torch.nn.Parameter] = ()) -> float:
        """All-reduces (SUM) the loss sums and counts; per-token mode divides gradients by the global count."""
        totals = torch.stack([self._loss_sum, self._tokens])
        if self.dp_size > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.dp_group)
        loss_sum, tokens = totals.tolist()
        if self.per_token and tokens > 0:
            grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / tokens)
        self._loss_sum = self._tokens = None
        return loss_sum / tokens if tokens > 0 else float("nan")


