"""The gated delta rule as fused recurrent triton kernels (imports triton): a forward kernel and a two-kernel
backward.

Same math and API as `kernels.gated_delta_rule.chunk_gated_delta_rule_reference` (q, k [B, T, Hk, K]; v [B, T, H, V]
with H a multiple of Hk — value head h reads key head h // (H / Hk); g, beta [B, T, H]; initial / final state
[B or documents, H, K, V]; packed documents by `cu_seqlens` over the flattened B*T tokens, `kernels/varlen.py`).

Forward: one program per (document, value head, block of value columns). It keeps its [K, BV] slice of the state
in registers (fp32) and walks its document's tokens in order:
    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - k_t^T S)^T;   o_t = S^T (q_t * scale)
Value columns are independent in this recurrence (k^T S is taken column by column), so splitting V across programs
is exact. A document's state starts at zero or its initial state and is written out at its last token, so no
state crosses a document boundary; an unpacked batch is B documents of T tokens. This is a fused *recurrent*
kernel (one token per step, no tensor cores), not the chunked WY form: simpler and exact, slower than a chunked
kernel on long sequences — which is why the dispatch prefers flash-linear-attention's chunked kernel when that is
importable (see `kernels.gated_delta_rule.chunk_gated_delta_rule`).

Backward: two more recurrent kernels over the same grid, state gradients in fp32 on chip (no per-token or
per-chunk states are stored; the forward keeps u_t = v_t - k_t^T S', fp32, the size of v):
1. reverse in time with dS: ddelta = dS^T k, dv, dbeta, the insertion part of dk, the initial-state gradient,
   and two of the three terms of dg (see `_fused_recurrent_bwd_reverse`);
2. forward in time, S rebuilt from the initial state and u: the removal part of dk (-beta S' ddelta), dq
   (S_t do) and the third dg term.
dg is the reverse cumulative sum over each document of per-token terms that need no state (the decay enters only
as e^{+-G} factors on q and k), taken in torch in float64. dq / dk sum over value heads and value blocks with
atomic adds (fp32; the order of those few additions may vary run to run on a GPU). The optional q/k l2
normalisation runs in torch before the kernels, so autograd differentiates it. Runs on CPU tensors under the
triton interpreter (TRITON_INTERPRET=1), as the tests do.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fsdp2_backend.kernels.gated_delta_rule_scan import l2_normalize

Tensor = torch.Tensor


@triton.jit
def _fused_recurrent_fwd(Q, K, V, G, BETA, H0, O, HT, U, CU, scale, H, HK, DK, DV,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, SAVE_U: tl.constexpr):
    doc = tl.program_id(0).to(tl.int64)  # int64 offsets: documents x heads x K x V can pass 2^31
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // (H // HK)  # grouped value heads: this value head's key head
    start = tl.load(CU + doc).to(tl.int64)
    end = tl.load(CU + doc + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    mk = ck < DK
    mv = cv < DV
    state_off = ((doc * H + h) * DK + ck[:, None]) * DV + cv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(H0 + state_off, mask=state_mask, other=0.0).to(tl.float32)
    for t in range(start, end):
        q = tl.load(Q + (t * HK + hk) * DK + ck, mask=mk, other=0.0).to(tl.float32) * scale
        k = tl.load(K + (t * HK + hk) * DK + ck, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(V + (t * H + h) * DV + cv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(G + t * H + h).to(tl.float32)
        beta = tl.load(BETA + t * H + h).to(tl.float32)
        state = state * tl.exp(g)
        u = v - tl.sum(k[:, None] * state, axis=0)  # [BV]: v_t - S^T k_t
        if SAVE_U:  # for the backward (fp32, the size of v)
            tl.store(U + (t * H + h) * DV + cv, u, mask=mv)
        state = state + k[:, None] * (u * beta)[None, :]
        o = tl.sum(q[:, None] * state, axis=0)
        tl.store(O + (t * H + h) * DV + cv, o.to(O.dtype.element_ty), mask=mv)
    tl.store(HT + state_off, state, mask=state_mask)


@triton.jit
def _fused_recurrent_bwd_reverse(Q, K, V, G, BETA, U, DO, DHT, DK, DV, DDELTA, DBETA_P, DG_P, DH0, CU,
                                 scale, T, H, HK, DK_DIM, DV_DIM, BK: tl.constexpr, BV: tl.constexpr,
                                 HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr):
    """Backward pass 1, walking each document's tokens in reverse with dS (the gradient of the state) in fp32.

    Per token (S' = exp(g) S_{t-1}, delta = beta u, u = v - S'^T k, S_t = S' + k delta^T, o = S_t^T q):
        dS += q do^T;  ddelta = dS^T k;  dk += dS delta (insertion; the removal part needs S', pass 2);
        dv = beta ddelta;  dbeta = u . ddelta;  dS <- exp(g) (dS - beta k ddelta^T).
    dg needs S' too; with G the cumulative log decay it is the reverse cumsum of
        dG_t = o_t . do_t  - delta_t . ddelta_t  - beta_t (v_t - u_t) . ddelta_t   (+ S_T . dS_T at the end)
    (q enters as q e^G, the inserted k as k e^-G, the removed k as k e^G): this pass writes the two ddelta
    terms, pass 2 the o . do term, the wrapper the rest. ddelta is kept for pass 2."""
    doc = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // (H // HK)
    start = tl.load(CU + doc).to(tl.int64)
    end = tl.load(CU + doc + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    mk = ck < DK_DIM
    mv = cv < DV_DIM
    state_off = ((doc * H + h) * DK_DIM + ck[:, None]) * DV_DIM + cv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    d_state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        d_state += tl.load(DHT + state_off, mask=state_mask, other=0.0).to(tl.float32)
    for i in range(end - start):
        t = end - 1 - i
        q = tl.load(Q + (t * HK + hk) * DK_DIM + ck, mask=mk, other=0.0).to(tl.float32) * scale
        k = tl.load(K + (t * HK + hk) * DK_DIM + ck, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(V + (t * H + h) * DV_DIM + cv, mask=mv, other=0.0).to(tl.float32)
        u = tl.load(U + (t * H + h) * DV_DIM + cv, mask=mv, other=0.0)
        do = tl.load(DO + (t * H + h) * DV_DIM + cv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(G + t * H + h).to(tl.float32)
        beta = tl.load(BETA + t * H + h).to(tl.float32)
        d_state += q[:, None] * do[None, :]
        d_delta = tl.sum(d_state * k[:, None], axis=0)  # [BV]
        delta = u * beta
        tl.atomic_add(DK + (t * HK + hk) * DK_DIM + ck, tl.sum(d_state * delta[None, :], axis=1), mask=mk)
        tl.store(DV + (t * H + h) * DV_DIM + cv, beta * d_delta, mask=mv)
        tl.store(DDELTA + (t * H + h) * DV_DIM + cv, d_delta, mask=mv)
        part = (vb * T + t) * H + h  # partial sums over this program's value columns: summed by the wrapper
        tl.store(DBETA_P + part, tl.sum(u * d_delta, axis=0))
        tl.store(DG_P + part, -tl.sum(delta * d_delta, axis=0) - beta * tl.sum((v - u) * d_delta, axis=0))
        d_state = (d_state - beta * k[:, None] * d_delta[None, :]) * tl.exp(g)
    if HAS_H0:
        tl.store(DH0 + state_off, d_state, mask=state_mask)


@triton.jit
def _fused_recurrent_bwd_forward(Q, K, G, BETA, U, H0, DO, DDELTA, DQ, DK, DG_P, CU, scale, T, H, HK, DK_DIM,
                                 DV_DIM, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr):
    """Backward pass 2, forward in time, rebuilding S from the initial state and the saved u:
        dk -= beta S' ddelta (the removed k);  dq += S_t do (w.r.t. the scaled q; times scale below);
        dG_t += o_t . do_t = (scaled q) . (S_t do)."""
    doc = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // (H // HK)
    start = tl.load(CU + doc).to(tl.int64)
    end = tl.load(CU + doc + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    mk = ck < DK_DIM
    mv = cv < DV_DIM
    state_off = ((doc * H + h) * DK_DIM + ck[:, None]) * DV_DIM + cv[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(H0 + state_off, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    for t in range(start, end):
        q = tl.load(Q + (t * HK + hk) * DK_DIM + ck, mask=mk, other=0.0).to(tl.float32) * scale
        k = tl.load(K + (t * HK + hk) * DK_DIM + ck, mask=mk, other=0.0).to(tl.float32)
        u = tl.load(U + (t * H + h) * DV_DIM + cv, mask=mv, other=0.0)
        do = tl.load(DO + (t * H + h) * DV_DIM + cv, mask=mv, other=0.0).to(tl.float32)
        d_delta = tl.load(DDELTA + (t * H + h) * DV_DIM + cv, mask=mv, other=0.0)
        g = tl.load(G + t * H + h).to(tl.float32)
        beta = tl.load(BETA + t * H + h).to(tl.float32)
        state = state * tl.exp(g)
        tl.atomic_add(DK + (t * HK + hk) * DK_DIM + ck, -beta * tl.sum(state * d_delta[None, :], axis=1), mask=mk)
        state = state + k[:, None] * (u * beta)[None, :]
        dq = tl.sum(state * do[None, :], axis=1)  # [BK]
        tl.atomic_add(DQ + (t * HK + hk) * DK_DIM + ck, dq * scale, mask=mk)
        part = (vb * T + t) * H + h
        tl.store(DG_P + part, tl.load(DG_P + part) + tl.sum(q * dq, axis=0))


def _launch_shape(k, v, cu_seqlens):
    batch, length, _, dk = k.shape
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch + 1, device=k.device) * length
    cu = cu_seqlens.to(device=k.device, dtype=torch.int64).contiguous()
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(v.shape[-1]), 32)  # [K, 32] fp32 of state per program: registers, not spills
    return cu, bk, bv, (cu.numel() - 1, v.shape[2], triton.cdiv(v.shape[-1], bv))


def _flat(*xs):
    return [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous() for x in xs]


def _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_u):
    """(o [B, T, H, V] in v's dtype, final state [documents, H, K, V] fp32, u [B*T, H, V] fp32 or None)."""
    batch, length, k_heads, dk = k.shape
    heads, dv = v.shape[2], v.shape[-1]
    cu, bk, bv, grid = _launch_shape(k, v, cu_seqlens)
    q, k, v, g, beta = _flat(q, k, v, g, beta)
    out = torch.empty_like(v)
    final = torch.empty(grid[0], heads, dk, dv, dtype=torch.float32, device=q.device)
    u = torch.empty(v.shape, dtype=torch.float32, device=q.device) if save_u else final  # (unwritten if not)
    h0 = initial_state.contiguous() if initial_state is not None else final  # (unread without HAS_H0)
    _fused_recurrent_fwd[grid](q, k, v, g, beta, h0, out, final, u, cu, scale, heads, k_heads, dk, dv,
                               BK=bk, BV=bv, HAS_H0=initial_state is not None, SAVE_U=save_u)
    return out.reshape(batch, length, heads, dv), final, (u if save_u else None)


def _backward(q, k, v, g, beta, u, initial_state, final, d_out, d_final, scale, cu_seqlens):
    """Gradients (fp32) of q, k, v, g, beta, initial state from the two passes above."""
    batch, length, k_heads, dk = k.shape
    heads, dv = v.shape[2], v.shape[-1]
    cu, bk, bv, grid = _launch_shape(k, v, cu_seqlens)
    tokens, n_vb = batch * length, grid[2]
    q, k, v, g, beta, d_out = _flat(q, k, v, g, beta, d_out)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk_ = torch.zeros(q.shape, **f32), torch.zeros(k.shape, **f32)  # accumulated over value heads / blocks
    dv_, d_delta = torch.empty(v.shape, **f32), torch.empty(v.shape, **f32)
    dbeta_p, dg_p = torch.empty(n_vb, tokens, heads, **f32), torch.empty(n_vb, tokens, heads, **f32)
    dh0 = torch.empty_like(final) if initial_state is not None else None
    d_final = d_final.contiguous() if d_final is not None else None
    _fused_recurrent_bwd_reverse[grid](q, k, v, g, beta, u, d_out, d_final if d_final is not None else final,
                                       dk_, dv_, d_delta, dbeta_p, dg_p, dh0 if dh0 is not None else final, cu,
                                       scale, tokens, heads, k_heads, dk, dv, BK=bk, BV=bv,
                                       HAS_DHT=d_final is not None, HAS_H0=initial_state is not None)
    h0 = initial_state.contiguous() if initial_state is not None else final
    _fused_recurrent_bwd_forward[grid](q, k, g, beta, u, h0, d_out, d_delta, dq, dk_, dg_p, cu, scale, tokens,
                                       heads, k_heads, dk, dv, BK=bk, BV=bv, HAS_H0=initial_state is not None)
    d_big_g = dg_p.sum(0).double()  # [tokens, H]
    if d_final is not None:  # the final state is S_T = e^{G_T} (...): its term sits at each document's last token
        d_big_g.index_add_(0, cu[1:] - 1, (final.double() * d_final.double()).sum((-1, -2)))
    dg = _segment_reverse_cumsum(d_big_g, cu).float()
    shape = lambda x: x.reshape(batch, length, *x.shape[1:])  # noqa: E731
    return shape(dq), shape(dk_), shape(dv_), shape(dg), shape(dbeta_p.sum(0)), dh0


def _segment_reverse_cumsum(x: Tensor, cu: Tensor) -> Tensor:
    """Sum over s >= t within t's document, for every token t (float64: the difference of two running sums)."""
    running = x.flip(0).cumsum(0).flip(0)
    after = torch.cat([running, running.new_zeros(1, *running.shape[1:])])  # running sum from each doc's end
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=x.device), cu[1:] - cu[:-1])
    return running - after[cu[1:]][doc]


class _TritonGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens):
        grad = any(ctx.needs_input_grad[:6])
        out, final, u = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_u=grad)
        ctx.save_for_backward(q, k, v, g, beta, u, initial_state, final, cu_seqlens)
        ctx.scale = scale
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, u, initial_state, final, cu_seqlens = ctx.saved_tensors
        grads = _backward(q, k, v, g, beta, u, initial_state, final, d_out, d_final, ctx.scale, cu_seqlens)
        inputs = (q, k, v, g, beta, initial_state)
        return (*[d.to(x.dtype) if d is not None else None for d, x in zip(grads, inputs)], None, None)


def triton_chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                                  chunk_size: int = 64, scale: Optional[float] = None,
                                  initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                                  cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False
                                  ) -> Tuple[Tensor, Optional[Tensor]]:
    """`chunk_gated_delta_rule_reference` by the triton kernels (same arguments, same result; `chunk_size` is
    accepted for the common signature and unused: both directions go token by token)."""
    del chunk_size
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:  # in torch, so autograd takes its gradient
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    out, final = _TritonGatedDeltaRule.apply(q, k, v, g, beta, initial_state, scale, cu_seqlens)
    return out, (final if output_final_state else None)
