"""The loss head under `optimization.torch_compile`: `masked_loss_sum` as two compiled kernels, whose backward
writes the logits' gradient over the logits.

Same contract as `training.loss.masked_loss_sum` (sum of cross entropy × loss_mask, number of unmasked tokens;
labels equal to -100 count nothing, as in `F.cross_entropy`), values equal up to fp32 rounding.

Why its own backward: compiled as one function, inductor fuses cross entropy's forward into one pass and its
backward into another, but the backward still writes a fresh vocabulary-sized tensor (tokens × vocab × 4 bytes,
131 MB for 1,024 tokens at a 32k vocabulary) each micro-batch. On a host that is a new mapping whose every page
the kernel zero-fills on first touch; on an accelerator, allocator traffic and memory. Here the forward (one
compiled kernel) keeps the log-sum-exp per token, and the backward (another) computes softmax − one-hot, times
the mask and the incoming gradient, into the logits' own storage and returns it — Megatron's cross entropy does
the same (`VocabParallelCrossEntropy` returns its softmax buffer as the gradient). The head's matmul backward
needs its inputs, not the logits, so nothing reads them afterwards; anything that saved them for its own
backward gets autograd's "modified by an inplace operation" error, never a wrong gradient. A second backward
through the same graph (`retain_graph`) is refused for the same reason.

Where it does not apply — the logits are a distributed tensor (tensor parallel's vocabulary-parallel head), do
not require a gradient, or autograd is off (evaluation) — the loss is the compiled `masked_loss_sum`, forward
only where there is no backward.
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch
from torch import Tensor

from fsdp2_backend.training.loss import masked_loss_sum

IGNORE_INDEX = -100  # F.cross_entropy's default, which masked_loss_sum inherits


def _rows(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(fp32 logits [tokens, V], labels with ignored ones at 0, per-token weight: mask × not ignored)."""
    x = logits.reshape(-1, logits.size(-1)).float()
    y = labels.reshape(-1).long()
    kept = y != IGNORE_INDEX
    return x, torch.where(kept, y, 0), loss_mask.reshape(-1).float() * kept


def _forward(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    x, y, weight = _rows(logits, labels, loss_mask)
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(1, y[:, None]).squeeze(1)
    return ((lse - target) * weight).sum(), loss_mask.reshape(-1).float().sum(), lse


def _backward_into(logits: Tensor, labels: Tensor, loss_mask: Tensor, lse: Tensor, grad_sum: Tensor) -> None:
    x, y, weight = _rows(logits, labels, loss_mask)
    one_hot = torch.arange(x.size(1), device=x.device)[None, :] == y[:, None]
    grad = (torch.exp(x - lse[:, None]) - one_hot.float()) * (weight * grad_sum)[:, None]
    logits.copy_(grad.reshape(logits.shape).to(logits.dtype))


@functools.cache
def _compiled(fn):
    """`fn` compiled, made on first use: importing the trainer compiles nothing and imports no dynamo."""
    return torch.compile(fn)


class _CrossEntropyOverLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, loss_mask: Tensor):
        loss_sum, count, lse = _compiled(_forward)(logits, labels, loss_mask)
        ctx.save_for_backward(logits, labels, loss_mask, lse)
        ctx.used = False
        return loss_sum, count

    @staticmethod
    def backward(ctx, grad_sum: Tensor, _grad_count: Tensor):
        if ctx.used:
            raise RuntimeError("the compiled loss head's backward ran twice: its first wrote the gradient over the "
                               "logits (retain_graph is not supported with optimization.torch_compile)")
        ctx.used = True
        logits, labels, loss_mask, lse = ctx.saved_tensors
        _compiled(_backward_into)(logits, labels, loss_mask, lse, grad_sum)
        return logits, None, None


def compiled_masked_loss_sum(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """`masked_loss_sum`, compiled, with the backward written over the logits where that applies (module doc)."""
    if type(logits) is not Tensor or not (logits.requires_grad and torch.is_grad_enabled()):
        return _compiled(masked_loss_sum)(logits, labels, loss_mask)
    return _CrossEntropyOverLogits.apply(logits, labels, loss_mask)
