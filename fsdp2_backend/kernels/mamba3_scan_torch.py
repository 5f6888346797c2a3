"""The Mamba-3 sequence mixer's scan in torch, chunked: linear in sequence length (forward and backward).

The recurrence (Lahoti et al. 2026, eq. "exponential-trapezoidal"), per head, state h (headdim × d_state):

    h_t = α_t h_{t-1} + β_t Σ_r k_{t-1,r} v_{t-1,r}ᵀ + γ_t Σ_r k_{t,r} v_{t,r}ᵀ,   y_{t,r} = h_t q_{t,r}
    α_t = exp(adt_t), λ_t = σ(trap_t), β_t = (1 − λ_t) dt_t α_t, γ_t = λ_t dt_t,

with q, k rotated by the data-dependent cumulative angle θ_t = Σ_{s≤t} π·tanh(angle_s)·dt_s (the complex state;
the first `num_angles` interleaved pairs of d_state rotate, the rest pass through). Unrolled, token j reaches
y_t (t > j) with weight decay(j→t)·w_j, w_j = γ_j + (1 − λ_{j+1}) dt_{j+1} (the next token's trapezoid half
folded into a scaled key), and at t = j with γ_j only: a diagonal correction of −(1 − λ_{t+1}) dt_{t+1}.
That is the Mamba-2 SSD form: per chunk of `chunk_size` tokens an intra-chunk quadratic term (chunk² per
chunk), plus the state entering the chunk, carried chunk to chunk (one state per chunk in memory). MIMO
(rank R > 1) flattens (token, rank) inside a chunk, so the quadratic block is (chunk·R)².

Packed documents (`doc_start`, True at each document's first token): the decay, the cumulative angle and the
previous-token term all restart there, so each document runs as if alone. The sequential recurrence, which
this must equal, lives in tests/kernels/test_mamba3_scan.py as the oracle. `kernels.mamba3_scan.mamba3_scan`
dispatches: on cuda the forward runs as a triton kernel (`mamba3_scan_triton`, which reuses `prepare_scan` and this
scan's backward), elsewhere this torch scan. Written here because the reference kernels (mamba_ssm's
triton/tilelang, fla's) are CUDA-only and MindSpeed's torch reference is quadratic in length.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

TWO_PI = 2 * math.pi


def segment_cumsum(x: torch.Tensor, doc_start: Optional[torch.Tensor]) -> torch.Tensor:
    """Cumulative sum over dim 1 restarting at every True of `doc_start` (b, l); done in float64 so long
    sequences keep their angle precision (cheap: angles are (b, l, h, a))."""
    cs = torch.cumsum(x.double(), dim=1)
    if doc_start is None:
        return cs
    b, l = doc_start.shape
    pos = torch.arange(l, device=x.device).expand(b, l)
    start = torch.cummax(torch.where(doc_start, pos, torch.zeros_like(pos)), dim=1).values
    before = (cs - x.double()).gather(1, start.view(b, l, *([1] * (x.dim() - 2))).expand_as(cs))
    return cs - before


def cumulative_angles(angles: torch.Tensor, dt: torch.Tensor, doc_start: Optional[torch.Tensor]) -> torch.Tensor:
    """θ_t = Σ π·tanh(angle)·dt per document, mod 2π (fp32). angles (b, l, h, a), dt (b, l, h)."""
    theta = segment_cumsum(torch.tanh(angles.float()) * math.pi * dt.float().unsqueeze(-1), doc_start)
    return (theta - TWO_PI * torch.floor(theta / TWO_PI)).float()


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first cos.shape[-1] interleaved pairs (x[2i], x[2i+1]) of x's last dim; the rest pass."""
    a = cos.shape[-1]
    rot, rest = x[..., :2 * a], x[..., 2 * a:]
    x0, x1 = rot.unflatten(-1, (a, 2)).unbind(-1)
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


def trapezoid_weights(dt: torch.Tensor, trap: torch.Tensor, doc_start: Optional[torch.Tensor]):
    """(w, shifted): w_j = λ_j dt_j + (1 − λ_{j+1}) dt_{j+1} and shifted_j = (1 − λ_{j+1}) dt_{j+1}, zero where
    j+1 starts a document or lies past the end. dt, trap (b, l, h) fp32."""
    lam = torch.sigmoid(trap.float())
    half_next = F.pad(((1 - lam) * dt)[:, 1:], (0, 0, 0, 1))
    if doc_start is not None:
        half_next = half_next * (~F.pad(doc_start[:, 1:], (0, 1), value=True)).unsqueeze(-1)
    return lam * dt + half_next, half_next


def prepare_scan(q, k, v, adt, dt, trap, angles, doc_start):
    """The per-token part shared by every scan implementation: q, k rotated (fp32), v fp32, adt fp32, the
    trapezoid weights (w, shifted) and the document id of each token (seg, (b, l) long)."""
    b, l = q.shape[:2]
    if doc_start is not None:
        doc_start = doc_start.clone()
        doc_start[:, 0] = True
    dt, adt = dt.float(), adt.float()
    theta = cumulative_angles(angles, dt, doc_start).unsqueeze(2)  # (b, l, 1, h, a): shared by the ranks
    cos, sin = torch.cos(theta), torch.sin(theta)
    q = rotate_pairs(q.float(), cos, sin)
    k = rotate_pairs(k.float(), cos, sin)
    w, shifted = trapezoid_weights(dt, trap, doc_start)
    seg = torch.zeros(b, l, dtype=torch.long, device=q.device) if doc_start is None else torch.cumsum(doc_start, 1)
    return q, k, v.float(), adt, w, shifted, seg


def mamba3_chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, adt: torch.Tensor, dt: torch.Tensor,
                      trap: torch.Tensor, angles: torch.Tensor, *, chunk_size: int = 64,
                      doc_start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Mamba-3 scan, chunked (see the module docstring). Returns y (b, l, r, h, p) in fp32.

    q, k: (b, l, r, h, n), biases added, not yet rotated; v: (b, l, r, h, p); adt = A·dt, dt, trap (the
    pre-sigmoid λ logit): (b, l, h); angles (b, l, h, a) pre-tanh, a ≤ n/2; doc_start (b, l) bool or None.
    """
    b, l, r, h, n = q.shape
    p = v.shape[-1]
    q, k, v, adt, w, shifted, seg = prepare_scan(q, k, v, adt, dt, trap, angles, doc_start)

    cs = chunk_size
    nc = -(-l // cs)
    pad = nc * cs - l
    if pad:  # padded tokens come last and carry zero weight: they reach no real output
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        adt, w, shifted = (F.pad(t, (0, 0, 0, pad)) for t in (adt, w, shifted))
        seg = F.pad(seg, (0, pad), value=-1)
    q = q.view(b, nc, cs, r, h, n)
    k = k.view(b, nc, cs, r, h, n)
    v = v.view(b, nc, cs, r, h, p)
    acs = torch.cumsum(adt.view(b, nc, cs, h), dim=2)  # log-decay from the chunk's start, ≤ 0, decreasing
    w = w.view(b, nc, cs, h)
    shifted = shifted.view(b, nc, cs, h)
    seg = seg.view(b, nc, cs)

    # intra-chunk: M[t, j] = exp(acs_t − acs_j)·w_j for j ≤ t in one document, minus the diagonal correction
    same_doc = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # (b, nc, t, j)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=q.device).tril()
    keep = (same_doc & causal).unsqueeze(-1)  # (b, nc, t, j, 1)
    log_decay = (acs.unsqueeze(3) - acs.unsqueeze(2)).masked_fill(~keep, -math.inf)  # (b, nc, t, j, h)
    coef = torch.exp(log_decay) * w.unsqueeze(2)
    coef = coef - torch.diag_embed(shifted.transpose(-1, -2)).permute(0, 1, 3, 4, 2)
    scores = torch.einsum("bctrhn,bcjshn->bchtrjs", q, k) * coef.permute(0, 1, 4, 2, 3)[..., :, None, :, None]
    y = torch.einsum("bchtrjs,bcjshp->bctrhp", scores, v)

    # chunk states: what each chunk adds to the state at its end (scaled keys w_j, decayed to the chunk's end)
    to_end = torch.exp(acs[:, :, -1:] - acs) * w * (seg == seg[:, :, -1:]).unsqueeze(-1)  # (b, nc, cs, h)
    chunk_states = torch.einsum("bcjshn,bcjshp->bchpn", k * to_end[:, :, :, None, :, None], v)  # 2-operand
    # einsums only: a 3-operand one may materialise a (chunk × p × n) product per token
    # a chunk passes the incoming state on only if no document starts inside it (its first token included)
    prev_seg = torch.cat([seg.new_full((b, 1), -2), seg[:, :-1, -1]], dim=1)  # last token of the previous chunk
    carry = torch.exp(acs[:, :, -1]) * (prev_seg == seg[:, :, -1]).unsqueeze(-1).to(acs.dtype)  # (b, nc, h)
    states = []
    state = torch.zeros(b, h, p, n, dtype=q.dtype, device=q.device)
    for c in range(nc):
        states.append(state)
        state = carry[:, c, :, None, None] * state + chunk_states[:, c]
    incoming = torch.stack(states, dim=1)  # (b, nc, h, p, n): the state entering each chunk

    # inter-chunk: the incoming state reaches token t if no document started in between
    from_start = torch.exp(acs) * (seg == prev_seg.unsqueeze(-1)).unsqueeze(-1)  # (b, nc, cs, h)
    y = y + torch.einsum("bctrhn,bchpn->bctrhp", q * from_start[:, :, :, None, :, None], incoming)
    return y.reshape(b, nc * cs, r, h, p)[:, :l]
