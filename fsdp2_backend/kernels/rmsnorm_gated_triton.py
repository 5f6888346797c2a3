"""The triton gated RMSNorm kernel, forward and backward, as a torch.autograd.Function (imports triton).

Same math as `kernels.rmsnorm_gated.rms_norm_gated_reference`. Forward: one program per (row, group); fp32
inside, the normalised value cast to the input dtype before the weight multiplies it (HF's rounding point), and
the group's 1/rms kept for the backward. Backward (h = x or x·silu(g), n = h·rstd, s = silu(g)):
norm before gate: y = n·w·s, so dn = dy·s·w, dg = dy·n·w·silu'(g), dw += dy·s·n;
gate before norm: y = n·w, so dn = dy·w, dw += dy·n, and dh splits into dx = dh·s, dg = dh·x·silu'(g);
dh = rstd·(dn − n·mean(dn·n)) over the group. Each backward program walks a contiguous run of rows for one
group and accumulates its partial dw in fp32; the partials are summed in torch (deterministic, no atomics).
Runs on CPU tensors under the triton interpreter (TRITON_INTERPRET=1), as the tests do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_grad(g):
    sig = 1.0 / (1.0 + tl.exp(-g))
    return g * sig, sig * (1.0 + g * (1.0 - sig))


@triton.jit
def _fwd(X, G, W, Y, RSTD, stride_x, stride_g, stride_y, NGROUPS, GS, eps,
         HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < GS
    off = grp * GS + cols
    x = tl.load(X + row * stride_x + off, mask=mask, other=0.0).to(tl.float32)
    h = x
    if HAS_GATE:
        g = tl.load(G + row * stride_g + off, mask=mask, other=0.0).to(tl.float32)
        s, _ = _silu_and_grad(g)
        if not NORM_BEFORE_GATE:
            h = x * s
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / GS + eps)
    n = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + off, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = n * w
    if HAS_GATE:
        if NORM_BEFORE_GATE:
            y = y * s
    tl.store(Y + row * stride_y + off, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row * NGROUPS + grp, rstd)


@triton.jit
def _bwd(DY, X, G, W, RSTD, DX, DG, DW_PARTIAL, stride_dy, stride_x, stride_g, stride_dx, stride_dg,
         M, N, NGROUPS, GS, rows_per_program,
         HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < GS
    off = grp * GS + cols
    w = tl.load(W + off, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for row in range(start, end):
        x = tl.load(X + row * stride_x + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row * NGROUPS + grp)
        h = x
        s = tl.full([BLOCK], 1.0, tl.float32)
        ds = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_GATE:
            g = tl.load(G + row * stride_g + off, mask=mask, other=0.0).to(tl.float32)
            s, ds = _silu_and_grad(g)
            if not NORM_BEFORE_GATE:
                h = x * s
        n = h * rstd
        if HAS_GATE and NORM_BEFORE_GATE:
            dyn = dy * s
            tl.store(DG + row * stride_dg + off, (dy * n * w * ds).to(DG.dtype.element_ty), mask=mask)
        else:
            dyn = dy
        dn = dyn * w
        dw += dyn * n
        dh = rstd * (dn - n * (tl.sum(dn * n, axis=0) / GS))
        if HAS_GATE and not NORM_BEFORE_GATE:
            tl.store(DG + row * stride_dg + off, (dh * x * ds).to(DG.dtype.element_ty), mask=mask)
            dx = dh * s
        else:
            dx = dh
        tl.store(DX + row * stride_dx + off, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * N + off, dw, mask=mask)


def _backward_programs(device: torch.device, rows: int, groups: int) -> int:
    """Enough programs to fill the GPU (a few per SM across the groups); a handful on the CPU interpreter."""
    if device.type == "cuda":
        target = max(1, 4 * torch.cuda.get_device_properties(device).multi_processor_count // groups)
    else:
        target = 4
    return max(1, min(rows, target))


class _TritonRMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps, group_size, norm_before_gate, zero_centered):
        shape = x.shape
        hidden = shape[-1]
        group = hidden if group_size is None else int(group_size)
        x2 = x.reshape(-1, hidden).contiguous()
        g2 = gate.reshape(-1, hidden).contiguous() if gate is not None else x2
        weight = weight.contiguous()
        rows, groups = x2.shape[0], hidden // group
        y = torch.empty_like(x2)
        rstd = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
        if rows:
            _fwd[(rows, groups)](x2, g2, weight, y, rstd, x2.stride(0), g2.stride(0), y.stride(0), groups, group,
                                 eps, HAS_GATE=gate is not None, NORM_BEFORE_GATE=norm_before_gate,
                                 ZERO_CENTERED=zero_centered, BLOCK=triton.next_power_of_2(group))
        ctx.save_for_backward(x2, g2 if gate is not None else None, weight, rstd)
        ctx.meta = (shape, group, norm_before_gate, zero_centered, gate is not None)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, weight, rstd = ctx.saved_tensors
        shape, group, norm_before_gate, zero_centered, has_gate = ctx.meta
        rows, hidden = x2.shape
        groups = hidden // group
        dy2 = dy.reshape(-1, hidden).contiguous()
        dx = torch.empty_like(x2)
        dg = torch.empty_like(g2) if has_gate else None
        if rows == 0:
            return dx.view(shape), None if dg is None else dg.view(shape), torch.zeros_like(weight), *([None] * 4)
        programs = _backward_programs(x2.device, rows, groups)
        rows_per_program = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rows_per_program)
        dw_partial = torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
        g_arg = g2 if has_gate else x2
        dg_arg = dg if has_gate else dx
        _bwd[(programs, groups)](dy2, x2, g_arg, weight, rstd, dx, dg_arg, dw_partial, dy2.stride(0), x2.stride(0),
                                 g_arg.stride(0), dx.stride(0), dg_arg.stride(0), rows, hidden, groups, group,
                                 rows_per_program, HAS_GATE=has_gate, NORM_BEFORE_GATE=norm_before_gate,
                                 ZERO_CENTERED=zero_centered, BLOCK=triton.next_power_of_2(group))
        return (dx.view(shape), None if dg is None else dg.view(shape), dw_partial.sum(0).to(weight.dtype),
                None, None, None, None)


def triton_rms_norm_gated(x, gate, weight, eps, *, group_size=None, norm_before_gate=True, zero_centered=False):
    """Gated RMSNorm over the last dim of x by the triton kernel (autograd supported); output in x's dtype."""
    return _TritonRMSNormGated.apply(x, gate, weight, eps, group_size, norm_before_gate, zero_centered)
