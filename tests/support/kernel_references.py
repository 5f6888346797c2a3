"""Plain-loop references for the recurrent kernels: Mamba-3's scan one step at a time (`sequential_oracle`) and
the gated delta rule token by token (`sequential_gated_delta_rule`), with the gated-delta-rule tests' inputs and
gradients."""
from __future__ import annotations

import math

import torch


def _rotate(x, theta):
    """Interleaved pairs (x[2i], x[2i+1]) rotated by theta[i] for i < len(theta); the rest unchanged."""
    out = x.clone()
    a = theta.shape[-1]
    x0, x1 = x[..., 0:2 * a:2], x[..., 1:2 * a:2]
    out[..., 0:2 * a:2] = x0 * torch.cos(theta) - x1 * torch.sin(theta)
    out[..., 1:2 * a:2] = x0 * torch.sin(theta) + x1 * torch.cos(theta)
    return out


def sequential_oracle(q, k, v, adt, dt, trap, angles, doc_start=None):
    """Token by token, in float64. Shapes as mamba3_chunk_scan's; returns y (b, l, r, h, p)."""
    q, k, v, adt, dt, trap, angles = (t.double() for t in (q, k, v, adt, dt, trap, angles))
    b, l, r, h, n = q.shape
    p = v.shape[-1]
    ys = []
    for t in range(l):
        if t == 0 or (doc_start is not None and bool(doc_start[:, t].any())):
            mask = torch.ones(b, dtype=torch.bool) if t == 0 else doc_start[:, t]
            fresh = (torch.zeros(b, h, angles.shape[-1], dtype=torch.float64), torch.zeros(b, h, p, n, dtype=torch.float64),
                     torch.zeros(b, r, h, n, dtype=torch.float64), torch.zeros(b, r, h, p, dtype=torch.float64))
            if t == 0:
                angle_state, state, k_prev, v_prev = fresh
            else:  # reset only the rows whose document starts here
                m = mask.double()
                angle_state = angle_state * (1 - m[:, None, None])
                state = state * (1 - m[:, None, None, None])
                k_prev = k_prev * (1 - m[:, None, None, None])
                v_prev = v_prev * (1 - m[:, None, None, None])
        angle_state = angle_state + torch.tanh(angles[:, t]) * math.pi * dt[:, t, :, None]
        angle_state = angle_state - 2 * math.pi * torch.floor(angle_state / (2 * math.pi))
        q_t = _rotate(q[:, t], angle_state[:, None])
        k_t = _rotate(k[:, t], angle_state[:, None])
        lam = torch.sigmoid(trap[:, t])
        alpha = torch.exp(adt[:, t])
        beta = (1 - lam) * dt[:, t] * alpha
        gamma = lam * dt[:, t]
        prev_kv = torch.einsum("brhn,brhp->bhpn", k_prev, v_prev)
        curr_kv = torch.einsum("brhn,brhp->bhpn", k_t, v[:, t])
        state = alpha[..., None, None] * state + beta[..., None, None] * prev_kv + gamma[..., None, None] * curr_kv
        ys.append(torch.einsum("bhpn,brhn->brhp", state, q_t))
        k_prev, v_prev = k_t, v[:, t]
    return torch.stack(ys, dim=1)


def mamba3_inputs(b, l, r, h, n, p, a, seed=0):
    """Seeded Mamba-3 scan inputs (q, k, v, adt, dt, trap, angles), each requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, l, r, h, n, generator=g)
    k = torch.randn(b, l, r, h, n, generator=g)
    v = torch.randn(b, l, r, h, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, l, h, generator=g) - 1)
    adt = -torch.nn.functional.softplus(torch.randn(b, l, h, generator=g)).clamp_min(1e-4) * dt
    trap = torch.randn(b, l, h, generator=g)
    angles = 2 * torch.randn(b, l, h, a, generator=g)
    return [t.requires_grad_() for t in (q, k, v, adt, dt, trap, angles)]


def sequential_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The token-by-token recurrence in float64; q/k [B, T, H, K] (heads already matched to v), v [B, T, H, V]."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    batch, length, heads, dk = k.shape
    state = (torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float64) if initial_state is None
             else initial_state.double().clone())
    outs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        kt, vt = k[:, t], v[:, t]
        delta = (vt - torch.einsum("bhk,bhkv->bhv", kt, state)) * beta[:, t, :, None]
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * dk ** -0.5, state))
    return torch.stack(outs, dim=1), state


def gdn_inputs(batch, length, heads, dk, dv, dtype, seed=0, k_heads=None):
    gen = torch.Generator().manual_seed(seed)
    k_heads = k_heads or heads

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = rand(batch, length, k_heads, dk)
    k = torch.nn.functional.normalize(rand(batch, length, k_heads, dk), dim=-1)  # as the model feeds it (l2norm)
    v = rand(batch, length, heads, dv)
    g = -torch.rand(batch, length, heads, generator=gen) * 0.5
    beta = torch.rand(batch, length, heads, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def gdn_grads(out, inputs, weight):
    return torch.autograd.grad((out.float() * weight).sum(), inputs)
