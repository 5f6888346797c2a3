"""The triton depthwise causal conv1d (Gated DeltaNet's short convolution), forward and backward, with the SiLU
activation fused and document resets for packed rows, as a torch.autograd.Function (imports triton).

Same math as `kernels.causal_conv1d.causal_conv1d_reference`: x [B, T, C] (channels last), weight [C, W],
    pre[t, c] = bias[c] + sum_j weight[c, j] * x[t - lag_j, c],   lag_j = W - 1 - j,   y = silu(pre) (or pre),
where tap j counts only while `position[t] >= lag_j` and `t >= lag_j`: with `cu_seqlens` the positions restart
at 0 at every document start (`kernels.varlen.position_ids_from_cu_seqlens`), so the window never reaches into the
previous document; taps before the row start are zero (as in the reference, also for a document that cu_seqlens
runs on from the previous row); without cu_seqlens position = t. fp32 inside, one rounding to x's dtype.

Forward: one program per (row, block of T, block of C); the W taps are W shifted masked loads of the block.
Backward (s = sigmoid(pre)): dpre = dy * s * (1 + pre * (1 - s)) — the pre-activation is recomputed by the
forward kernel (one extra pass over x instead of keeping a [B, T, C] fp32 tensor), written in fp32; then
    dx[t] = sum_j weight[:, j] * dpre[t + lag_j]   (where t + lag_j is still in t's document: position >= lag_j),
    dweight[:, j] = sum_t dpre[t] * x[t - lag_j],   dbias = sum_t dpre[t],
each backward program walking a run of T blocks and writing its fp32 partial dweight / dbias, summed in torch
(deterministic, no atomics). Runs on CPU tensors under the triton interpreter (TRITON_INTERPRET=1), as the tests do.
Written here rather than taken from Dao-AILab's causal-conv1d or flash-linear-attention: both are CUDA-only
packages that break a CPU install, and the former has no document resets in its training path.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fsdp2_backend.kernels.varlen import position_ids_from_cu_seqlens

BLOCK_T = 32  # tokens per program
BLOCK_C = 64  # channels per program


@triton.jit
def _conv_pre(X, W, BIAS, POS, row, t, c, tmask, cmask, T, C, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The pre-activation [BLOCK_T, BLOCK_C] in fp32 of tokens t, channels c of one row."""
    if HAS_POS:
        pos = tl.load(POS + row * T + t, mask=tmask, other=0)
    else:
        pos = t
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(WIDTH):
        lag = WIDTH - 1 - j
        # inside t's document and inside the row (taps before the row start are zero, as in the reference, even
        # where cu_seqlens lets a document run on from the previous row)
        valid = tmask & (pos >= lag) & (t >= lag)
        xs = tl.load(X + (row * T + t - lag)[:, None] * C + c[None, :], mask=valid[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        w = tl.load(W + c * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xs * w[None, :]
    return acc


@triton.jit
def _fwd(X, W, BIAS, POS, DY, OUT, T, C, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
         SILU: tl.constexpr, GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """GRAD False: OUT = act(pre) in OUT's dtype. GRAD True: OUT = dy * act'(pre) in fp32 (the backward's dpre)."""
    row = tl.program_id(0).to(tl.int64)  # offsets in int64: B*T*C may pass 2**31
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask, cmask = t < T, c < C
    pre = _conv_pre(X, W, BIAS, POS, row, t, c, tmask, cmask, T, C, WIDTH, HAS_BIAS, HAS_POS, BLOCK_T, BLOCK_C)
    offsets = (row * T + t)[:, None] * C + c[None, :]
    mask = tmask[:, None] & cmask[None, :]
    if GRAD:
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            s = 1.0 / (1.0 + tl.exp(-pre))
            dy = dy * s * (1.0 + pre * (1.0 - s))
        tl.store(OUT + offsets, dy, mask=mask)
    else:
        if SILU:
            pre = pre / (1.0 + tl.exp(-pre))
        tl.store(OUT + offsets, pre.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(X, W, POS, DPRE, DX, DW_PARTIAL, DB_PARTIAL, T, C, blocks_per_program, WIDTH: tl.constexpr,
         HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # offsets in int64: B*T*C may pass 2**31
    pid_t = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    partial = row * tl.num_programs(1) + pid_t  # this program's row of the partial sums
    db = tl.zeros([BLOCK_C], dtype=tl.float32)
    first = pid_t * blocks_per_program
    last = tl.minimum(first + blocks_per_program, tl.cdiv(T, BLOCK_T))
    for j in tl.static_range(WIDTH):  # dweight column j, accumulated over this program's T blocks
        lag = WIDTH - 1 - j
        dw = tl.zeros([BLOCK_C], dtype=tl.float32)
        for block in range(first, last):
            t = block * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < T
            if HAS_POS:
                pos = tl.load(POS + row * T + t, mask=tmask, other=0)
            else:
                pos = t
            mask = tmask[:, None] & cmask[None, :]
            d = tl.load(DPRE + (row * T + t)[:, None] * C + c[None, :], mask=mask, other=0.0)
            xs = tl.load(X + (row * T + t - lag)[:, None] * C + c[None, :],
                         mask=(tmask & (pos >= lag) & (t >= lag))[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            dw += tl.sum(d * xs, axis=0)
            if j == 0:
                db += tl.sum(d, axis=0)
        tl.store(DW_PARTIAL + partial * C * WIDTH + c * WIDTH + j, dw, mask=cmask)
    tl.store(DB_PARTIAL + partial * C + c, db, mask=cmask)
    for block in range(first, last):  # dx: token t feeds t + lag_j while that token is still in t's document
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            lag = WIDTH - 1 - j
            ts = t + lag
            smask = ts < T
            if HAS_POS:
                pos_s = tl.load(POS + row * T + ts, mask=smask, other=0)
            else:
                pos_s = ts
            valid = smask & (pos_s >= lag)
            d = tl.load(DPRE + (row * T + ts)[:, None] * C + c[None, :], mask=valid[:, None] & cmask[None, :],
                        other=0.0)
            w = tl.load(W + c * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
            dx += d * w[None, :]
        tl.store(DX + (row * T + t)[:, None] * C + c[None, :], dx.to(DX.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


def _t_programs(device: torch.device, rows: int, t_blocks: int, c_blocks: int) -> int:
    """Backward programs along T per row: enough to fill the GPU (a few per SM); two on the CPU interpreter."""
    if device.type == "cuda":
        target = max(1, 4 * torch.cuda.get_device_properties(device).multi_processor_count // (rows * c_blocks))
    else:
        target = 2
    return max(1, min(t_blocks, target))


class _TritonCausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, position, silu, block_t, block_c):
        x, weight = x.contiguous(), weight.contiguous()
        batch, length, channels = x.shape
        out = torch.empty_like(x)
        pos = position if position is not None else x  # a placeholder pointer when unused
        bias_arg = bias if bias is not None else weight
        grid = (batch, triton.cdiv(length, block_t), triton.cdiv(channels, block_c))
        if x.numel():
            _fwd[grid](x, weight, bias_arg, pos, x, out, length, channels, WIDTH=weight.shape[1],
                       HAS_BIAS=bias is not None, HAS_POS=position is not None, SILU=silu, GRAD=False,
                       BLOCK_T=block_t, BLOCK_C=block_c)
        ctx.save_for_backward(x, weight, bias, position)
        ctx.meta = (silu, block_t, block_c)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, position = ctx.saved_tensors
        silu, block_t, block_c = ctx.meta
        batch, length, channels = x.shape
        width = weight.shape[1]
        dy = dy.contiguous()
        pos = position if position is not None else x
        bias_arg = bias if bias is not None else weight
        t_blocks, c_blocks = triton.cdiv(length, block_t), triton.cdiv(channels, block_c)
        dx = torch.empty_like(x)
        if not x.numel():
            return dx, torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias), *([None] * 4)
        dpre = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        if silu:
            _fwd[(batch, t_blocks, c_blocks)](x, weight, bias_arg, pos, dy, dpre, length, channels, WIDTH=width,
                                              HAS_BIAS=bias is not None, HAS_POS=position is not None, SILU=True,
                                              GRAD=True, BLOCK_T=block_t, BLOCK_C=block_c)
        else:
            dpre.copy_(dy)
        programs = _t_programs(x.device, batch, t_blocks, c_blocks)
        per_program = triton.cdiv(t_blocks, programs)
        programs = triton.cdiv(t_blocks, per_program)
        dw_partial = torch.empty((batch * programs, channels, width), dtype=torch.float32, device=x.device)
        db_partial = torch.empty((batch * programs, channels), dtype=torch.float32, device=x.device)
        _bwd[(batch, programs, c_blocks)](x, weight, pos, dpre, dx, dw_partial, db_partial, length, channels,
                                          per_program, WIDTH=width, HAS_POS=position is not None,
                                          BLOCK_T=block_t, BLOCK_C=block_c)
        dbias = None if bias is None else db_partial.sum(0).to(bias.dtype)
        return dx, dw_partial.sum(0).to(weight.dtype), dbias, None, None, None, None


def triton_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         activation: Optional[str] = "silu", cu_seqlens: Optional[torch.Tensor] = None, *,
                         block_t: int = BLOCK_T, block_c: int = BLOCK_C) -> torch.Tensor:
    """Depthwise causal conv1d by the triton kernels (autograd supported): x [B, T, C], weight [C, W], bias [C];
    `cu_seqlens` over the flattened B*T tokens resets the window at each document. Output in x's dtype."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: unsupported activation {activation!r} (silu or None)")
    batch, length, channels = x.shape
    if weight.shape[0] != channels:
        raise ValueError(f"causal_conv1d: weight has shape {tuple(weight.shape)}, expected ({channels}, width)")
    position = None
    if cu_seqlens is not None:
        position = position_ids_from_cu_seqlens(cu_seqlens.to(x.device), batch, length).to(torch.int32)
    return _TritonCausalConv1d.apply(x, weight, bias, position, activation is not None, block_t, block_c)
