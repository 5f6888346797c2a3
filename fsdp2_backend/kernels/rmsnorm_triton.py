"""The triton RMSNorm kernel, forward and backward, as a torch.autograd.Function (imports triton).

Forward: one program per row; fp32 inside the kernel (the input is cast up, the normalised row cast back to the
input dtype before the weight multiplies it, as HF does), and the row's 1/rms is kept for the backward.
Backward: dx = rstd * (g - n * mean(g * n)) with g = dy * w and n = x * rstd; each program walks a contiguous
run of rows and accumulates its partial dw in fp32, and the partials are summed in torch (no atomics, so the
result is deterministic). Runs on CPU tensors under the triton interpreter (TRITON_INTERPRET=1), as the tests do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for row in range(start, end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x * rstd
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * n
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)


def _backward_programs(device: torch.device, rows: int) -> int:
    """Enough programs to fill the GPU (a few per SM); a handful on the CPU interpreter."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    return max(1, min(rows, target))


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        weight = weight.contiguous()
        rows, hidden = x2.shape
        y = torch.empty((rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(hidden)
        if rows:
            _rms_norm_fwd[(rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), hidden, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = dy.reshape(-1, hidden).contiguous()
        dx = torch.empty_like(x2)
        if rows == 0:
            return dx.view(ctx.shape), torch.zeros_like(weight), None
        programs = _backward_programs(x2.device, rows)
        rows_per_program = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rows_per_program)
        dw_partial = torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
        _rms_norm_bwd[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                                   rows, hidden, rows_per_program, BLOCK=triton.next_power_of_2(hidden))
        return dx.view(ctx.shape), dw_partial.sum(0).to(weight.dtype), None


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x by the triton kernel (autograd supported)."""
    return _TritonRMSNorm.apply(x, weight, eps)
