"""The chunked gated delta rule's core as one torch.autograd.Function with a hand-written backward: the fp32 scan
behind `kernels.gated_delta_rule.chunk_gated_delta_rule_reference` (which prepares the inputs: fp32, l2 norm,
scale, padding / document layout).

Why hand-written: autograd through the chunk loop recorded ~20 small ops per chunk and, for every broadcast over
grouped value heads or over the chunk, a full-size product and a reduction in the backward; on CPU that
elementwise traffic cost as much as the matmuls. Here the backward is the chunked rule's own adjoint (as in fla's
chunk backward), in a few batched matmuls plus one reverse loop over chunks whose small matmuls stay in cache,
with the rest fused into in-place updates (`baddbmm_`, `addcmul_`). Nothing per token is saved beyond the
forward's chunk tensors and the per-chunk states, so memory stays linear in the sequence length.

Layout: chunk index first, so that one chunk's slice is contiguous: q, k [n, B, Hk, 1, C, K]; v [n, B, Hk, G, C,
V]; g, beta [n, B, Hk, G, C] (value head Hk-index * G + G-index reads key head Hk-index). Per chunk, with
gc = cumsum(g), D[r, c] = exp(gc_r - gc_c) (r >= c, else 0), T = (I + strict_lower(beta_r k k^T ⊙ D))^-1 (one
unit-triangular solve), u = T (beta v), w = T (beta exp(gc) k), and S the state before the chunk:
    v_new = u - w S;   o = (q exp(gc)) S + ((q k^T) ⊙ D) v_new;   S' = exp(gc_C) S + (k exp(gc_C - gc))^T v_new.
Backward (dS' the gradient of the next state; a document's last chunk takes its final state's gradient):
    dv_new = ((q k^T) ⊙ D)^T do + k~ dS';   dS = exp(gc_C) dS' + q~^T do - w^T dv_new      (the reverse loop)
then dq~ = do S^T, dw = -dv_new S^T, dk~ = v_new dS'^T, and through the UT form
d(beta v) = T^T dv_new, d(beta k~') = T^T dw, dA = -strict_lower((d(beta v) (beta v)^T + d(beta k~') (beta k~')^T) T^T),
back to q, k, v, beta and gc, whose reverse cumsum is dg.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor


def _bmm_acc(out: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """out += alpha * a @ b over matching leading dims (out contiguous), as one baddbmm_ call."""
    out.view(-1, *out.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), alpha=alpha)
    return out


class ChunkedGatedDeltaRule(torch.autograd.Function):
    """(q, k, v, g, beta, initial_state, starts) → (o [n, B, Hk, G, C, V], final states [B or docs, Hk, G, K, V]).

    `starts`: None (every row one sequence; initial_state [B, Hk, G, K, V] or None) or the first chunk of each
    document (B == 1; initial_state [docs, 1, Hk, G, K, V] or None). q is already scaled."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, starts: Optional[List[int]]):
        n, batch, k_heads, group, chunk, dv = v.shape
        dk = k.shape[-1]
        gc = g.cumsum(-1)
        upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
        decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()
        k_t = k.transpose(-1, -2)
        kk, qk = k @ k_t, q @ k_t  # once per key head, broadcast over the group
        # solve_triangular reads only the strict lower part (unit diagonal); D is 0 above the diagonal anyway.
        a = kk * decay * beta.unsqueeze(-1)
        eye = torch.eye(chunk, dtype=q.dtype, device=q.device).expand_as(a)
        inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        del a
        eg = gc.exp()
        u = inverse @ (v * beta.unsqueeze(-1))
        w = inverse @ (k * (beta * eg).unsqueeze(-1))
        aqk = qk * decay
        last = gc[..., -1:]
        k_dec = k * (last - gc).exp_().unsqueeze(-1)  # [n, B, Hk, G, C, K]
        step = last.exp().unsqueeze(-1)  # exp(gc_C): the state's decay over the chunk, [n, B, Hk, G, 1, 1]

        state_shape = (batch, k_heads, group, dk, dv)
        states = q.new_empty(n, *state_shape)  # the state before each chunk
        v_new = torch.empty_like(u)
        doc_of_start = {s: j for j, s in enumerate(starts)} if starts is not None else {0: None}
        doc_starts = set(doc_of_start)
        finals = []
        for i in range(n):
            if i in doc_starts:  # a sequence / document starts: its initial state (or zero), nothing carried over
                if initial_state is None:
                    states[i].zero_()
                else:
                    states[i].copy_(initial_state if starts is None else initial_state[doc_of_start[i]])
            s = states[i]
            torch.baddbmm(u[i].view(-1, chunk, dv), w[i].view(-1, chunk, dk), s.view(-1, dk, dv), alpha=-1,
                          out=v_new[i].view(-1, chunk, dv))
            ends = i + 1 == n or i + 1 in doc_starts
            nxt = q.new_empty(state_shape) if ends else states[i + 1]
            torch.mul(s, step[i], out=nxt)
            _bmm_acc(nxt, k_dec[i].transpose(-1, -2), v_new[i])
            if ends:
                finals.append(nxt)
        out = q * eg.unsqueeze(-1) @ states + aqk @ v_new  # [n, B, Hk, G, C, V]
        final = torch.cat(finals) if starts is not None else finals[0]
        ctx.save_for_backward(q, k, v, beta, gc, decay, kk, qk, inverse, w, v_new, states)
        ctx.starts = starts
        ctx.has_initial = initial_state is not None
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, beta, gc, decay, kk, qk, inverse, w, v_new, states = ctx.saved_tensors
        starts = ctx.starts
        n = v.shape[0]
        d_out = d_out.contiguous()
        eg = gc.exp()
        last = gc[..., -1:]
        k_decay = (last - gc).exp()
        k_dec = k * k_decay.unsqueeze(-1)
        q_dec = q * eg.unsqueeze(-1)
        step = last.exp().unsqueeze(-1)
        aqk = qk * decay

        # The reverse loop: d_next[i] = gradient of the state after chunk i; d_vn[i] = gradient of v_new[i].
        doc_starts = set(starts) if starts is not None else {0}
        n_docs = len(starts) if starts is not None else 1
        d_vn = aqk.transpose(-1, -2) @ d_out
        d_next = torch.empty_like(states)
        d_initial = [None] * n_docs
        doc = n_docs - 1

        def final_grad(index):
            if d_final is None:
                return None
            return d_final[index] if starts is not None else d_final

        grad = final_grad(doc)
        if grad is None:
            d_next[n - 1].zero_()
        else:
            d_next[n - 1].copy_(grad)
        for i in range(n - 1, -1, -1):
            _bmm_acc(d_vn[i], k_dec[i], d_next[i])
            if i in doc_starts:
                target = q.new_empty(states.shape[1:])
            else:
                target = d_next[i - 1]
            torch.mul(d_next[i], step[i], out=target)
            _bmm_acc(target, q_dec[i].transpose(-1, -2), d_out[i])
            _bmm_acc(target, w[i].transpose(-1, -2), d_vn[i], alpha=-1.0)
            if i in doc_starts:
                d_initial[doc] = target
                doc -= 1
                if i > 0:
                    grad = final_grad(doc)
                    if grad is None:
                        d_next[i - 1].zero_()
                    else:
                        d_next[i - 1].copy_(grad)
        d_init = None
        if ctx.has_initial:
            d_init = torch.stack(d_initial) if starts is not None else d_initial[0]

        states_t = states.transpose(-1, -2)
        d_q_dec = d_out @ states_t  # [n, B, Hk, G, C, K]
        d_w = d_vn @ states_t  # (negated below)
        d_k_dec = v_new @ d_next.transpose(-1, -2)
        d_step = (d_next * states).sum((-1, -2))  # [n, B, Hk, G]
        d_aqk = d_out @ v_new.transpose(-1, -2)

        # Through the UT form: u = T (beta v), w = T (beta exp(gc) k); d(beta k exp(gc)) = -T^T dw_raw.
        inverse_t = inverse.transpose(-1, -2)
        bv = v * beta.unsqueeze(-1)
        bk = k * (beta * eg).unsqueeze(-1)
        d_bv = inverse_t @ d_vn
        d_bk = inverse_t @ d_w
        d_bk.neg_()
        x = d_bv @ bv.transpose(-1, -2)
        _bmm_acc(x, d_bk, bk.transpose(-1, -2))
        d_a = (x @ inverse_t).tril_(-1).neg_()  # strict lower part: the unit diagonal is not a variable
        del x

        d_v = d_bv * beta.unsqueeze(-1)
        d_bk_k = (d_bk * k).sum(-1)  # [n, B, Hk, G, C]: d(beta exp(gc)) per token
        d_beta = (d_bv * v).sum(-1) + d_bk_k * eg
        # a = kk ⊙ D ⊙ beta_r; aqk = qk ⊙ D
        p_k = d_a * decay  # dA ⊙ D
        d_beta = d_beta + (p_k * kk).sum(-1)
        p_q = d_aqk * decay
        e = (p_k * beta.unsqueeze(-1)) * kk + p_q * qk  # dD ⊙ D
        d_gc = e.sum(-1) - e.sum(-2)
        d_kk = (p_k * beta.unsqueeze(-1)).sum(3, keepdim=True)
        d_qk = p_q.sum(3, keepdim=True)
        d_q = d_qk @ k + (d_q_dec * eg.unsqueeze(-1)).sum(3, keepdim=True)
        d_k = (d_kk + d_kk.transpose(-1, -2)) @ k + d_qk.transpose(-1, -2) @ q
        d_k += (d_k_dec * k_decay.unsqueeze(-1) + d_bk * (beta * eg).unsqueeze(-1)).sum(3, keepdim=True)
        d_gc += (d_q_dec * q_dec).sum(-1) + d_bk_k * beta * eg
        t = (d_k_dec * k_dec).sum(-1)
        d_gc -= t
        d_last = t.sum(-1) + d_step * step[..., 0, 0]
        d_gc[..., -1] += d_last
        d_g = d_gc.flip(-1).cumsum(-1).flip(-1)
        return d_q, d_k, d_v, d_g, d_beta, d_init, None


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
