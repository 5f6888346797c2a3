"""The chunked gated delta rule's core as one torch.autograd.Function with a hand-written backward: the fp32 scan
behind `kernels.gated_delta_rule.chunk_gated_delta_rule_reference` (which prepares the inputs: fp32, l2 norm,
scale, padding / document layout).

Why hand-written: autograd through the chunk loop recorded ~20 small ops per chunk and, for every broadcast over
grouped value heads or over the chunk, a full-size product and a reduction in the backward; on CPU that
elementwise traffic (and the page faults of fresh sequence-sized temporaries) cost as much as the matmuls. Here
the backward is the chunked rule's own adjoint (as in fla's chunk backward): one reverse loop over chunks whose
small matmuls write into preallocated buffers (`out=`, `baddbmm_`), then the elementwise tail. Both passes run in
blocks of `BLOCK` chunks, so elementwise temporaries are sized by the block, never by the sequence; what is kept
for the backward is the chunk tensors of the inputs, the UT inverses, [q exp(gc); -w], v_new and the per-chunk
states — linear in the sequence length (measured: benchmarks/bench_gdn.py).

Layout: chunk index first, so that one chunk's slice is contiguous: q, k [n, B, Hk, 1, C, K]; v [n, B, Hk, G, C,
V]; g, beta [n, B, Hk, G, C] (value head Hk-index * G + G-index reads key head Hk-index); per-chunk matmuls run
over the m = B * Hk * G (row, value head) pairs. Per chunk, with gc = cumsum(g), D[r, c] = exp(gc_r - gc_c)
(r >= c, else 0), T = (I + strict_lower(beta_r k k^T ⊙ D))^-1 (one unit-triangular solve for all chunks),
u = T (beta v), w = T (beta exp(gc) k), and S the state before the chunk:
    v_new = u - w S;   o = (q exp(gc)) S + ((q k^T) ⊙ D) v_new;   S' = exp(gc_C) S + (k exp(gc_C - gc))^T v_new
([q exp(gc); -w] S is one [2C, K] x [K, V] product). Backward, dS' being the gradient of the next state (a
document's last chunk takes its final state's gradient):
    dv_new = ((q k^T) ⊙ D)^T do + k~ dS';   dS = exp(gc_C) dS' + [q exp(gc); -w]^T [do; dv_new]
    d[q exp(gc); -w] = [do; dv_new] S^T;   dk~ = v_new dS'^T;   d(beta v) = T^T dv_new;   d(-beta exp(gc) k) = T^T d(-w)
    dA = -strict_lower((d(beta v) (beta v)^T + d(-beta exp(gc) k) (-beta exp(gc) k)^T) T^T)
then back through the elementwise products to q, k, v, beta and gc, whose reverse cumsum within the chunk is dg.
Checked by `torch.autograd.gradcheck` in float64 and against the sequential oracle (tests/kernels/test_gated_delta_rule.py).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor

BLOCK = 16  # chunks per block: elementwise temporaries are allocated per block, never for the whole sequence


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, on the inputs of either scan (fla's and transformers' `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _blocks(n: int):
    return [(lo, min(lo + BLOCK, n)) for lo in range(0, n, BLOCK)]


class ChunkedGatedDeltaRule(torch.autograd.Function):
    """(q, k, v, g, beta, initial_state, starts) → (o [n, B, Hk, G, C, V], final states [B or docs, Hk, G, K, V]).

    `starts`: None (every row one sequence; initial_state [B, Hk, G, K, V] or None) or the first chunk of each
    document (B == 1; initial_state [docs, 1, Hk, G, K, V] or None). q is already scaled; all fp32."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, starts: Optional[List[int]]):
        n, batch, k_heads, group, chunk, dv = v.shape
        dk = k.shape[-1]
        m = batch * k_heads * group  # the (row, value head) pairs: the batch of every per-chunk matmul
        gc = g.cumsum(-1)
        upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
        decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()
        k_t = k.transpose(-1, -2)
        kk, qk = k @ k_t, q @ k_t  # once per key head, broadcast over the group
        a = kk * decay * beta.unsqueeze(-1)
        eye = torch.eye(chunk, dtype=q.dtype, device=q.device).expand_as(a)
        inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        del a
        qw = q.new_empty(n, m, 2 * chunk, dk)  # qw[i] = [q exp(gc); -w]: one operand for both products with S
        states = q.new_empty(n, m, dk, dv)  # the state before each chunk
        out = v.new_empty(n, m, chunk, dv)
        v_new = torch.empty_like(out)
        scratch = q.new_empty(m, 2 * chunk, dv)
        doc_of_start = {s: j for j, s in enumerate(starts)} if starts is not None else {0: None}
        if initial_state is not None:
            initial_shape = initial_state.shape
            initial_state = initial_state.reshape(-1, m, dk, dv)
        finals = []
        for lo, hi in _blocks(n):
            sl = slice(lo, hi)
            bv, bk, k_dec, step, eg = _block_operands(k, v, gc[sl], beta[sl], m, sl)
            torch.mul(q[sl], eg.unsqueeze(-1), out=qw[sl, :, :chunk].view(hi - lo, batch, k_heads, group, chunk, dk))
            inv = inverse[sl].view(hi - lo, m, chunk, chunk)
            aqk = (qk[sl] * decay[sl]).view(hi - lo, m, chunk, chunk)
            for j, i in enumerate(range(lo, hi)):
                s = states[i]
                if i in doc_of_start:
                    if initial_state is None:
                        s.zero_()
                    else:
                        s.copy_(initial_state[0 if starts is None else doc_of_start[i]])
                torch.bmm(inv[j], bk[j], out=qw[i, :, chunk:])
                torch.bmm(qw[i], s, out=scratch)
                torch.baddbmm(scratch[:, chunk:], inv[j], bv[j], out=v_new[i])  # T beta v - w S
                torch.baddbmm(scratch[:, :chunk], aqk[j], v_new[i], out=out[i])
                ends = i + 1 == n or i + 1 in doc_of_start
                nxt = q.new_empty(m, dk, dv) if ends else states[i + 1]
                torch.mul(s, step[j], out=nxt)
                nxt.baddbmm_(k_dec[j].transpose(1, 2), v_new[i])
                if ends:
                    finals.append(nxt)
        final = torch.stack(finals).view(-1 if starts is not None else batch, k_heads, group, dk, dv)
        ctx.save_for_backward(q, k, v, beta, gc, decay, kk, qk, inverse, qw, v_new, states)
        ctx.starts = starts
        ctx.initial_shape = None if initial_state is None else initial_shape
        return out.view(v.shape), final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, beta, gc, decay, kk, qk, inverse, qw, v_new, states = ctx.saved_tensors
        starts = ctx.starts
        n, batch, k_heads, group, chunk, dv = v.shape
        dk = k.shape[-1]
        m = batch * k_heads * group
        d_out = d_out.contiguous().view(n, m, chunk, dv)
        doc_of_start = {s: j for j, s in enumerate(starts)} if starts is not None else {0: None}
        n_docs = len(starts) if starts is not None else 1
        d_initial = [None] * n_docs
        if d_final is not None:
            d_final = d_final.reshape(-1, m, dk, dv)

        def reset(buffer, doc):  # the gradient reaching a document's final state
            if d_final is None:
                buffer.zero_()
            else:
                buffer.copy_(d_final[doc])

        d_q, d_k = torch.empty_like(q), torch.empty_like(k)
        d_v, d_g, d_beta = torch.empty_like(v), torch.empty_like(beta), torch.empty_like(beta)
        nb = min(BLOCK, n)
        d_qw = q.new_empty(nb, m, 2 * chunk, dk)
        d_k_dec = q.new_empty(nb, m, chunk, dk)
        d_aqk = q.new_empty(nb, m, chunk, chunk)
        d_bv = q.new_empty(nb, m, chunk, dv)
        d_bk = q.new_empty(nb, m, chunk, dk)
        d_a = q.new_empty(nb, m, chunk, chunk)
        d_step = q.new_empty(nb, m)
        dd = q.new_empty(m, 2 * chunk, dv)  # [d_out; d_v_new] of the chunk
        x = q.new_empty(m, chunk, chunk)
        d_next, d_here = q.new_empty(m, dk, dv), q.new_empty(m, dk, dv)
        reset(d_next, n_docs - 1)
        for lo, hi in reversed(_blocks(n)):
            sl = slice(lo, hi)
            bv, bk, k_dec, step, eg = _block_operands(k, v, gc[sl], beta[sl], m, sl)
            inv = inverse[sl].view(hi - lo, m, chunk, chunk)
            aqk = (qk[sl] * decay[sl]).view(hi - lo, m, chunk, chunk)
            for i in range(hi - 1, lo - 1, -1):
                j = i - lo
                s, vn, inv_t = states[i], v_new[i], inv[j].transpose(1, 2)
                d_vn = dd[:, chunk:]
                torch.bmm(aqk[j].transpose(1, 2), d_out[i], out=d_vn)
                d_vn.baddbmm_(k_dec[j], d_next)
                dd[:, :chunk].copy_(d_out[i])
                torch.bmm(dd, s.transpose(1, 2), out=d_qw[j])
                torch.bmm(vn, d_next.transpose(1, 2), out=d_k_dec[j])
                torch.sum((d_next * s).view(m, -1), -1, out=d_step[j])
                torch.bmm(d_out[i], vn.transpose(1, 2), out=d_aqk[j])
                torch.bmm(inv_t, d_vn, out=d_bv[j])
                torch.bmm(inv_t, d_qw[j, :, chunk:], out=d_bk[j])
                torch.bmm(d_bv[j], bv[j].transpose(1, 2), out=x)
                x.baddbmm_(d_bk[j], bk[j].transpose(1, 2))
                torch.bmm(x, inv_t, out=d_a[j])
                torch.mul(d_next, step[j], out=d_here)
                d_here.baddbmm_(qw[i].transpose(1, 2), dd)
                if i in doc_of_start:
                    doc = doc_of_start[i] if starts is not None else 0
                    d_initial[doc] = d_here.clone()
                    if i > 0:
                        reset(d_next, doc - 1)
                else:
                    d_next, d_here = d_here, d_next
            size = hi - lo
            grads = _block_tail(q[sl], k[sl], v[sl], beta[sl], gc[sl], decay[sl], kk[sl], qk[sl], eg,
                                d_qw[:size], d_k_dec[:size], d_aqk[:size], d_bv[:size], d_bk[:size], d_a[:size],
                                d_step[:size], step)
            for target, grad in zip((d_q, d_k, d_v, d_g, d_beta), grads):
                target[sl] = grad
        d_init = None
        initial_shape = ctx.initial_shape
        if initial_shape is not None:
            d_init = torch.stack(d_initial).view(initial_shape)
        return d_q, d_k, d_v, d_g, d_beta, d_init, None


def _block_operands(k, v, gc, beta, m, sl):
    """Per block of chunks: beta v, -beta exp(gc) k, k exp(gc_C - gc) as [block, m, C, D], exp(gc_C) [block, m, 1, 1],
    exp(gc)."""
    size, chunk = gc.shape[0], gc.shape[-1]
    eg = gc.exp()
    last = gc[..., -1:]
    bv = (v[sl] * beta.unsqueeze(-1)).view(size, m, chunk, -1)
    bk = (k[sl] * (beta * eg).neg_().unsqueeze(-1)).view(size, m, chunk, -1)
    k_dec = (k[sl] * (last - gc).exp_().unsqueeze(-1)).view(size, m, chunk, -1)
    return bv, bk, k_dec, last.exp().view(size, m, 1, 1), eg


def _block_tail(q, k, v, beta, gc, decay, kk, qk, eg, d_qw, d_k_dec, d_aqk, d_bv, d_bk, d_a, d_step, step):
    """The gradients of one block's q, k, v, g, beta from the loop's per-chunk products (elementwise and small
    matmuls)."""
    shape = beta.shape  # [block, B, Hk, G, C]
    chunk = shape[-1]
    d_a = d_a.view(*shape, chunk).tril_(-1).neg_()  # strict lower: the unit diagonal is not a variable
    d_bv, d_bk = d_bv.view(*shape, -1), d_bk.view(*shape, -1)
    d_q_dec = d_qw[:, :, :chunk].reshape(*shape, -1)
    d_k_dec = d_k_dec.view(*shape, -1)
    last = gc[..., -1:]
    k_decay = (last - gc).exp()
    d_v = d_bv * beta.unsqueeze(-1)
    d_bk_k = (d_bk * k).sum(-1).neg_()  # d(beta exp(gc)) per token (bk = -beta exp(gc) k)
    d_beta = (d_bv * v).sum(-1) + d_bk_k * eg
    p_k = d_a * decay
    d_beta += (p_k * kk).sum(-1)
    p_q = d_aqk.view(*shape, chunk) * decay
    p_k *= beta.unsqueeze(-1)
    e = p_k * kk + p_q * qk  # dD ⊙ D
    d_gc = e.sum(-1) - e.sum(-2)
    d_kk = p_k.sum(3, keepdim=True)
    d_qk = p_q.sum(3, keepdim=True)
    d_q = d_qk @ k + (d_q_dec * eg.unsqueeze(-1)).sum(3, keepdim=True)
    d_k = (d_kk + d_kk.transpose(-1, -2)) @ k + d_qk.transpose(-1, -2) @ q
    d_k += (d_k_dec * k_decay.unsqueeze(-1) - d_bk * (beta * eg).unsqueeze(-1)).sum(3, keepdim=True)
    d_gc += (d_q_dec * q).sum(-1) * eg + d_bk_k * beta * eg
    t = (d_k_dec * k).sum(-1) * k_decay
    d_gc -= t
    d_gc[..., -1] += t.sum(-1) + d_step.view(shape[:-1]) * step.view(shape[:-1])
    d_g = d_gc.flip(-1).cumsum(-1).flip(-1)
    return d_q, d_k, d_v, d_g, d_beta


# Eager inside compiled blocks (optimization.torch_compile): dynamo would unroll the chunk loop and break at every
# `out=` into a strided buffer (8 breaks and minutes of compiling per Gated DeltaNet layer on CPU, measured with
# benchmarks/compile_model_ids.py); the hand-written forward and backward are already the fused form.
@torch.compiler.disable
def chunked_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
                 doc_first_chunks: Optional[List[int]], initial_state: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The rule on fp32 [B, T, heads, D] tensors (q already scaled), T a multiple of chunk_size: q, k with Hk
    heads, v [B, T, H, V], g, beta [B, T, H]. Without `doc_first_chunks` every row is one sequence
    (initial_state [B, H, K, V]); with it B == 1 and the state restarts at each listed chunk (initial_state
    [docs, H, K, V]). Returns (o [B, T, H, V], final states [B or docs, H, K, V])."""
    batch, length, k_heads, dk = k.shape
    heads, dv = v.shape[2], v.shape[-1]
    n, group = length // chunk_size, heads // k_heads

    def chunked(x, inner):  # [B, T, Hk*G(, D)] -> [n, B, Hk, G, C(, D)], one copy
        x = x.reshape(batch, n, chunk_size, k_heads, x.shape[2] // k_heads, *inner)
        return x.permute(1, 0, 3, 4, 2, *range(5, x.dim())).contiguous()

    q, k, v = chunked(q, (dk,)), chunked(k, (dk,)), chunked(v, (dv,))
    g, beta = chunked(g, ()), chunked(beta, ())
    if initial_state is not None:
        shape = (k_heads, group, dk, dv)
        initial_state = (initial_state.reshape(-1, 1, *shape) if doc_first_chunks is not None
                         else initial_state.reshape(batch, *shape))
    out, final = ChunkedGatedDeltaRule.apply(q, k, v, g, beta, initial_state, doc_first_chunks)
    out = out.permute(1, 0, 4, 2, 3, 5).reshape(batch, length, heads, dv)
    return out, final.reshape(final.shape[0], heads, dk, dv)
