"""MXFP8 linear and grouped (MoE experts) linear: all three GEMMs of a linear layer quantised, as torchao's recipe.

    forward      y  = x  @ W.T     x blocked along K (row-wise), W blocked along K (row-wise)
    grad input   dx = dy @ W       dy blocked along N, W blocked along N (column-wise: W.T row-wise)
    grad weight  dW = dy.T @ x     dy.T and x.T blocked along the token dim M

torchao's `mx_mm` (moe_training.mxfp8_linear) quantises the weight inside each call; here the weight's two
quantisations come from a `WeightQuantizer` (`rowwise()` / `colwise()`), so they can be computed once per
optimizer step, or arrive already quantised from FSDP's low-precision all-gather
(`fsdp2_backend.parallel.mx.weight`). A plain tensor gets `PlainQuantizer` (quantised on each call).
torchao's MXFP8 grouped GEMM needs CUDA layouts (its emulated path refuses CPU strides here), so the grouped
version is written here too, as one MX GEMM per expert over that expert's rows.

The token dim of the weight-gradient GEMM is zero-padded to a multiple of 32 (zeros change neither a block's
amax nor the sums); torchao requires it to be a multiple already.
"""
from __future__ import annotations

from typing import Protocol, Tuple

import torch
import torch.nn.functional as F

from fsdp2_backend.kernels.mx import BLOCK, mx_mm, mx_quantize

MX = Tuple[torch.Tensor, torch.Tensor]  # (E4M3 elements, E8M0 scales)


class WeightQuantizer(Protocol):
    def rowwise(self) -> MX:
        """W (N, K) quantised in blocks along K."""

    def colwise(self) -> MX:
        """W.T (K, N) quantised in blocks along N."""


class PlainQuantizer:
    """The quantisations of a plain weight tensor, computed on each call (the reference path)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def rowwise(self) -> MX:
        return mx_quantize(self.weight.detach())

    def colwise(self) -> MX:
        return mx_quantize(self.weight.detach().t().contiguous())


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """(rows, M) → (rows, M rounded up to a multiple of 32), zero-filled."""
    pad = -t.shape[-1] % BLOCK
    return F.pad(t, (0, pad)) if pad else t


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW = grad.T @ x with both operands blocked along the token dim: grad (M, N), x (M, K) → (N, K)."""
    return mx_mm(mx_quantize(_pad_tokens(grad.t())), mx_quantize(_pad_tokens(x.t())), dtype)


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, quantizer: WeightQuantizer) -> torch.Tensor:
        ctx.quantizer, ctx.weight_dtype = quantizer, weight.dtype
        ctx.save_for_backward(x)
        x2 = x.reshape(-1, x.shape[-1])
        out = mx_mm(mx_quantize(x2), quantizer.rowwise(), x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = mx_mm(mx_quantize(g2), ctx.quantizer.colwise(), x.dtype).reshape(x.shape)
        grad_w = _weight_grad(g2, x2, ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              quantizer: WeightQuantizer | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the three GEMMs in MXFP8; `quantizer` supplies W's quantisations."""
    out = _MXLinear.apply(x, weight, PlainQuantizer(weight) if quantizer is None else quantizer)
    return out if bias is None else out + bias.to(out.dtype)


class _MXGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = [int(c) for c in counts.tolist()]
        ctx.sizes = sizes
        ctx.save_for_backward(x, weight)
        w = weight.detach()
        outs = [mx_mm(mx_quantize(rows), mx_quantize(w[e]), x.dtype) if rows.shape[0] else
                rows.new_zeros(0, w.shape[1]) for e, rows in enumerate(x.split(sizes))]
        return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        w = weight.detach()
        grad = grad.contiguous()
        grad_x, grad_w = [], torch.zeros_like(w)
        for e, (rows, g) in enumerate(zip(x.split(ctx.sizes), grad.split(ctx.sizes))):
            if not rows.shape[0]:
                grad_x.append(rows.new_zeros(0, w.shape[2]))
                continue
            grad_x.append(mx_mm(mx_quantize(g), mx_quantize(w[e].t().contiguous()), x.dtype))
            grad_w[e] = _weight_grad(g, rows, w.dtype)
        return torch.cat(grad_x) if grad_x else x.new_zeros(0, w.shape[2]), grad_w, None


def mx_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each expert e, `x[rows of e] @ weight[e].T` in MXFP8 (x (T, K) grouped by `counts`, weight (E, N, K))."""
    return _MXGroupedLinear.apply(x, weight, counts)
