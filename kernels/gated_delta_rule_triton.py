"""The gated delta rule's forward as one fused recurrent triton kernel (imports triton); backward by recomputing the
torch chunked reference under autograd.

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

Backward: NOT in triton. Only the inputs are kept; the backward reruns the torch chunked reference
(`chunk_gated_delta_rule_reference`, chunk size as given) with autograd and returns its gradients, so training
memory during backward is the reference's (linear in the sequence). The optional q/k l2 normalisation runs in torch
before the kernel. Runs on CPU tensors under the triton interpreter (TRITON_INTERPRET=1), as the tests do.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule import chunk_gated_delta_rule_reference, l2_normalize

Tensor = torch.Tensor


@triton.jit
def _fused_recurrent_fwd(Q, K, V, G, BETA, H0, O, HT, CU, scale, H, HK, DK, DV,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr):
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
        delta = (v - tl.sum(k[:, None] * state, axis=0)) * beta  # [BV]: v_t - S^T k_t, weighted
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * state, axis=0)
        tl.store(O + (t * H + h) * DV + cv, o.to(O.dtype.element_ty), mask=mv)
    tl.store(HT + state_off, state, mask=state_mask)


def _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """(o [B, T, H, V] in v's dtype, final state [documents, H, K, V] fp32)."""
    batch, length, k_heads, dk = k.shape
    heads, dv = v.shape[2], v.shape[-1]
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch + 1, device=q.device) * length
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    docs = cu.numel() - 1
    q, k, v, g, beta = (x.reshape(batch * length, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    final = torch.empty(docs, heads, dk, dv, dtype=torch.float32, device=q.device)
    h0 = initial_state.contiguous() if initial_state is not None else final  # (unread without HAS_H0)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), 32)  # [K, 32] fp32 of state per program: registers, not spills
    grid = (docs, heads, triton.cdiv(dv, bv))
    _fused_recurrent_fwd[grid](q, k, v, g, beta, h0, out, final, cu, scale, heads, k_heads, dk, dv,
                               BK=bk, BV=bv, HAS_H0=initial_state is not None)
    return out.reshape(batch, length, heads, dv), final


class _TritonGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, cu_seqlens, use_qk_l2norm_in_kernel):
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.chunk_size, ctx.l2norm = scale, chunk_size, use_qk_l2norm_in_kernel
        return _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        inputs = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, g, beta, initial_state)]
        with torch.enable_grad():
            out, final = chunk_gated_delta_rule_reference(
                *inputs[:5], chunk_size=ctx.chunk_size, scale=ctx.scale, initial_state=inputs[5],
                output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=ctx.l2norm)
        leaves = [x for x in inputs if x is not None]
        grads = iter(torch.autograd.grad((out, final), leaves, (d_out, d_final), allow_unused=True))
        return (*[next(grads) if x is not None else None for x in inputs], None, None, None, None)


def triton_chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                                  chunk_size: int = 64, scale: Optional[float] = None,
                                  initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                                  cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False
                                  ) -> Tuple[Tensor, Optional[Tensor]]:
    """`chunk_gated_delta_rule_reference` with the forward by the triton kernel (same arguments, same result;
    `chunk_size` is the backward's, the forward being token by token)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    out, final = _TritonGatedDeltaRule.apply(q, k, v, g, beta, initial_state, scale, chunk_size, cu_seqlens,
                                             use_qk_l2norm_in_kernel)
    return out, (final if output_final_state else None)
