"""The Mamba-3 chunked scan's forward as one triton kernel (imports triton); backward by the torch scan.

The per-token preparation (rotation by the cumulative angles, trapezoid weights, document ids) is
`kernels.mamba3_scan_torch.prepare_scan` in torch; the kernel does the chunked part, one program per (batch, head):
it walks the chunks in order keeping the (headdim × d_state) state in registers, and per chunk computes the
intra-chunk quadratic term (rows = (token, rank) pairs, so MIMO's (chunk·R)² block is one dot), the incoming
state's contribution, and the state it passes on — the same formulas as `mamba3_chunk_scan`. Nothing but the
inputs is kept for backward: the backward recomputes the torch scan with autograd (so training memory is the
torch scan's during backward only). Runs on CPU tensors under the triton interpreter (TRITON_INTERPRET=1), as
the tests do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fsdp2_backend.kernels.mamba3_scan_torch import mamba3_chunk_scan, prepare_scan


@triton.jit
def _chunk_scan_fwd(Q, K, V, ACS, W, SH, SEG, Y, H, NC, CS, R, N, P,
                    BLOCK: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    rows_per_chunk = CS * R
    seq_rows = NC * rows_per_chunk
    seq_tokens = NC * CS
    i = tl.arange(0, BLOCK)
    cn = tl.arange(0, BN)
    cp = tl.arange(0, BP)
    valid = i < rows_per_chunk
    state = tl.zeros([BP, BN], dtype=tl.float32)
    for c in range(NC):
        rows = c * rows_per_chunk + i
        tok = c * CS + i // R
        qc = tl.load(Q + (bh * seq_rows + rows)[:, None] * N + cn[None, :],
                     mask=valid[:, None] & (cn[None, :] < N), other=0.0)
        kc = tl.load(K + (bh * seq_rows + rows)[:, None] * N + cn[None, :],
                     mask=valid[:, None] & (cn[None, :] < N), other=0.0)
        vc = tl.load(V + (bh * seq_rows + rows)[:, None] * P + cp[None, :],
                     mask=valid[:, None] & (cp[None, :] < P), other=0.0)
        a = tl.load(ACS + bh * seq_tokens + tok, mask=valid, other=0.0)
        w = tl.load(W + bh * seq_tokens + tok, mask=valid, other=0.0)
        sh = tl.load(SH + bh * seq_tokens + tok, mask=valid, other=0.0)
        seg = tl.load(SEG + b * seq_tokens + tok, mask=valid, other=-3)
        prev_seg = tl.load(SEG + b * seq_tokens + tl.maximum(c * CS - 1, 0))
        prev_seg = tl.where(c > 0, prev_seg, -2)
        end = c * CS + CS - 1
        a_end = tl.load(ACS + bh * seq_tokens + end)
        seg_end = tl.load(SEG + b * seq_tokens + end)

        # intra-chunk: (q_i · k_j) · [exp(a_i − a_j) w_j for j ≤ i in one document − shifted_i on the diagonal]
        scores = tl.dot(qc, tl.trans(kc), input_precision="ieee")
        ti = (i // R)[:, None]
        tj = (i // R)[None, :]
        keep = (tj <= ti) & (seg[:, None] == seg[None, :]) & valid[:, None] & valid[None, :]
        decay = tl.exp(tl.where(keep, a[:, None] - a[None, :], float("-inf")))
        coef = decay * w[None, :] - tl.where(keep & (ti == tj), sh[:, None], 0.0)
        y = tl.dot(scores * coef, vc, input_precision="ieee")
        # the state entering the chunk, where no document started in between
        from_start = tl.where(seg == prev_seg, tl.exp(a), 0.0)
        y += from_start[:, None] * tl.dot(qc, tl.trans(state), input_precision="ieee")
        tl.store(Y + (bh * seq_rows + rows)[:, None] * P + cp[None, :], y,
                 mask=valid[:, None] & (cp[None, :] < P))
        # the state passed on: decayed incoming state (if no document starts here) + this chunk's scaled keys
        to_end = tl.where((seg == seg_end) & valid, tl.exp(a_end - a) * w, 0.0)
        carry = tl.where(prev_seg == seg_end, tl.exp(a_end), 0.0)
        state = carry * state + tl.dot(tl.trans(vc * to_end[:, None]), kc, input_precision="ieee")


def _forward(q, k, v, adt, dt, trap, angles, chunk_size, doc_start):
    b, l, r, h, n = q.shape
    p = v.shape[-1]
    q, k, v, adt, w, shifted, seg = prepare_scan(q, k, v, adt, dt, trap, angles, doc_start)
    cs = chunk_size
    nc = -(-l // cs)
    pad = nc * cs - l
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        adt, w, shifted = (F.pad(t, (0, 0, 0, pad)) for t in (adt, w, shifted))
        seg = F.pad(seg, (0, pad), value=-1)
    acs = torch.cumsum(adt.view(b, nc, cs, h), dim=2).view(b, nc * cs, h)

    def rows(t):  # (b, L, r, h, d) → (b·h, L·r, d): one program's (token, rank) rows contiguous
        return t.permute(0, 3, 1, 2, 4).reshape(b * h, nc * cs * r, t.shape[-1]).contiguous()

    def tokens(t):  # (b, L, h) → (b·h, L)
        return t.permute(0, 2, 1).reshape(b * h, nc * cs).contiguous()

    y = torch.empty(b * h, nc * cs * r, p, dtype=torch.float32, device=q.device)
    block = max(16, triton.next_power_of_2(cs * r))
    _chunk_scan_fwd[(b * h,)](rows(q), rows(k), rows(v), tokens(acs), tokens(w), tokens(shifted),
                              seg.to(torch.int32).contiguous(), y, h, nc, cs, r, n, p, BLOCK=block,
                              BN=max(16, triton.next_power_of_2(n)), BP=max(16, triton.next_power_of_2(p)))
    return y.view(b, h, nc * cs, r, p).permute(0, 2, 3, 1, 4)[:, :l]


class _TritonChunkScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, adt, dt, trap, angles, chunk_size, doc_start):
        ctx.save_for_backward(q, k, v, adt, dt, trap, angles)
        ctx.chunk_size, ctx.doc_start = chunk_size, doc_start
        return _forward(q, k, v, adt, dt, trap, angles, chunk_size, doc_start)

    @staticmethod
    def backward(ctx, dy):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            y = mamba3_chunk_scan(*inputs, chunk_size=ctx.chunk_size, doc_start=ctx.doc_start)
        grads = torch.autograd.grad(y, inputs, dy, allow_unused=True)
        return (*grads, None, None)


def triton_mamba3_chunk_scan(q, k, v, adt, dt, trap, angles, *, chunk_size=64, doc_start=None):
    """`mamba3_chunk_scan` with the forward by the triton kernel (same arguments, same result)."""
    return _TritonChunkScan.apply(q, k, v, adt, dt, trap, angles, chunk_size, doc_start)
