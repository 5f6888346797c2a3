"""The chunked gated delta rule (Gated DeltaNet's linear attention): the torch reference, the triton kernel and
the Ascend op, behind one entry point `chunk_gated_delta_rule` that the model calls.

The recurrence, per head, with state S (K x V), for t = 1..T (q scaled by 1/sqrt(K)):
    S <- exp(g_t) * S;   S <- S + beta_t * k_t (v_t - k_t^T S)^T;   o_t = S^T q_t
The reference computes it chunk by chunk (WY / UT form, as in the Gated DeltaNet paper): inside a chunk of C
tokens everything is batched matmuls and one unit-triangular solve; only the C x-smaller state hand-off runs as a
loop over chunks (never one per token). Everything runs in fp32 whatever the input dtype; the output is cast
back. Gradients come from autograd through these ops (the chunk's UT inverse has a two-matmul backward of its
own, `_UnitLowerInverse`): the per-chunk states are the only thing kept per chunk,
so memory stays linear in the sequence length. transformers' own torch fallback writes each chunk's output into
one preallocated tensor in place, whose backward copies the whole gradient once per chunk (quadratic); here
chunk outputs are computed after the state scan in one batched matmul.

Packed documents (`cu_seqlens`, see `kernels/varlen.py`): every document is laid out from a chunk boundary
(zero padding up to the next multiple of C: a padded token has k = v = 0, beta = 0, g = 0, so it neither
updates nor decays the state), and the state is reset (to zero or that document's initial state) at each
document's first chunk, so no state leaks from one document into the next.

Implementations (chosen by the project, never by what happens to be importable):
- "torch": the reference below (any device);
- "triton" (`use_triton_gdn`, CUDA only): flash-linear-attention's `chunk_gated_delta_rule` (chunked, triton fwd +
  bwd, with cu_seqlens) when that package is importable — this project does not install it, and transformers'
  own hub-kernel lookup is never used; otherwise this project's own kernel, `kernels/gated_delta_rule_triton.py`
  (fused recurrent triton forward and backward kernels). fla's is preferred because it is
  chunked (tensor-core matmuls) and has a triton backward; ours is the always-available triton path;
- "npu": the AscendC op of torch_npu that MindSpeed calls (`use_flash_gdn`); a clear error elsewhere.
"""
from __future__ import annotations

import importlib.util
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from usage_errors import UsageError

Tensor = torch.Tensor
IMPLEMENTATIONS = ("torch", "triton", "npu")


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and transformers' `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunk_layout(cu_seqlens: Tensor, chunk_size: int) -> Tuple[Tensor, Tensor, List[int], int]:
    """For packed documents: (destination index of every token in the chunk-aligned buffer, padded length,
    first chunk of each document, number of documents)."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + chunk_size - 1) // chunk_size * chunk_size
    padded_offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    token = torch.arange(int(cu[-1]), device=cu.device)
    destination = padded_offsets[doc] + (token - cu[doc])
    first_chunks = (padded_offsets[:-1] // chunk_size).tolist()
    return destination, padded_offsets[-1], first_chunks, lengths.numel()


class _UnitLowerInverse(torch.autograd.Function):
    """(I + A)^-1 for A strictly lower triangular [..., C, C] (what A holds on and above the diagonal is ignored).

    Forward: a triangular solve against the identity (C right-hand sides, where solving for u and w directly
    takes K + V: a quarter of the solve at head dim 128, and no concatenated right-hand side); backward:
    d(M^-1) = -M^-1 dM M^-1, so dA = -M^-T dInv M^-T on the strictly lower part — two matmuls, where autograd
    through a solve would solve again. (A hand-written backward for the chunk loop was tried as well and was
    not faster than autograd's on CPU: the loop is matmul-bound.)"""

    @staticmethod
    def forward(ctx, a: Tensor) -> Tensor:
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
        inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(inverse)
        return inverse

    @staticmethod
    def backward(ctx, d_inverse: Tensor) -> Tensor:
        (inverse,) = ctx.saved_tensors
        inverse_t = inverse.transpose(-1, -2)
        return (-(inverse_t @ d_inverse @ inverse_t)).tril(-1)


def _scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
          doc_first_chunks: Optional[List[int]], initial_state: Optional[Tensor]):
    """The chunked rule on fp32 [B, heads, T, D] tensors — q, k with Hk heads, v, g, beta with H (a multiple of
    Hk) — T a multiple of chunk_size (q already scaled).

    Without `doc_first_chunks` every row is one sequence (initial_state [B, H, K, V]); with it B == 1 and the
    state restarts at each listed chunk (initial_state [docs, H, K, V]). Returns (o [B, H, T, V], final states
    [B or docs, H, K, V])."""
    batch, k_heads, length, dk = k.shape
    heads, dv = v.shape[1], v.shape[-1]
    n, group = length // chunk_size, heads // k_heads
    # Grouped value heads: value head j reads key head j // group. Products of q and k alone (q k^T, k k^T) are
    # computed once per key head and broadcast over the group (dim 2), never on repeated copies.
    q, k = (x.reshape(batch, k_heads, 1, n, chunk_size, dk) for x in (q, k))
    v = v.reshape(batch, k_heads, group, n, chunk_size, dv)
    g, beta = (x.reshape(batch, k_heads, group, n, chunk_size) for x in (g, beta))
    g_cum = g.cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = prod of exp(g) over (j, i] for j <= i, 0 above the diagonal (masked before the exp).
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_t = k.transpose(-1, -2)
    # UT transform: (I + strictly_lower(beta k k^T * decay)) [u, w] = [beta v, beta k exp(g_cum)], by the
    # explicit inverse (one C-wide triangular solve, then two batched matmuls; see `_UnitLowerInverse`).
    inverse = _UnitLowerInverse.apply((k @ k_t) * (beta.unsqueeze(-1) * decay))
    u = (inverse @ (v * beta.unsqueeze(-1))).flatten(1, 2)
    w = (inverse @ (k * (beta * g_cum.exp()).unsqueeze(-1))).flatten(1, 2)
    intra = ((q @ k_t) * decay).flatten(1, 2)  # causal inside the chunk, diagonal included
    q_decayed = (q * g_cum.exp().unsqueeze(-1)).flatten(1, 2)
    k_decayed = (k * (g_cum[..., -1:] - g_cum).exp().unsqueeze(-1)).flatten(1, 2)
    chunk_decay = g_cum[..., -1].exp()[..., None, None].flatten(1, 2)
    q = q_decayed  # (for the dtype / device of the zero state below)

    starts = set(doc_first_chunks or [])
    n_states = len(doc_first_chunks) if doc_first_chunks is not None else batch
    zero = q.new_zeros(1 if doc_first_chunks is not None else batch, heads, dk, dv)
    state = zero if initial_state is None or doc_first_chunks is not None else initial_state
    states_before, new_values, finals = [], [], []
    doc = -1
    # unbind, not u[:, :, i]: the backward of one `unbind` stacks the chunk gradients once, whereas each indexed
    # read's backward would allocate a zero tensor of the whole sequence (quadratic in the number of chunks).
    chunks = zip(u.unbind(2), w.unbind(2), k_decayed.transpose(-1, -2).unbind(2), chunk_decay.unbind(2))
    for i, (u_i, w_i, k_i, decay_i) in enumerate(chunks):
        if i in starts:
            if doc >= 0:
                finals.append(state)
            doc += 1
            state = zero if initial_state is None else initial_state[doc:doc + 1]
        v_new = u_i - w_i @ state
        states_before.append(state)
        new_values.append(v_new)
        state = state * decay_i + k_i @ v_new
    finals.append(state)
    states = torch.stack(states_before, dim=2)  # [B, H, n, K, V]
    v_new = torch.stack(new_values, dim=2)  # [B, H, n, C, V]
    out = q_decayed @ states + intra @ v_new
    final = torch.cat(finals, dim=0) if doc_first_chunks is not None else state
    assert final.shape[0] == n_states
    return out.reshape(batch, heads, length, dv), final


def chunk_gated_delta_rule_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                                     chunk_size: int = 64, scale: Optional[float] = None,
                                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                                     cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False
                                     ) -> Tuple[Tensor, Optional[Tensor]]:
    """The torch reference. q, k [B, T, Hk, K]; v [B, T, H, V] (H a multiple of Hk: grouped value heads);
    g (log decay, <= 0) and beta [B, T, H]. With `cu_seqlens` (over the flattened B*T tokens) documents are
    independent and states are per document. Returns (o [B, T, H, V] in v's dtype, final state or None)."""
    out_dtype = v.dtype
    batch, length, k_heads, dk = k.shape
    heads = v.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    if cu_seqlens is not None:
        destination, padded, first_chunks, _ = _chunk_layout(cu_seqlens, chunk_size)
        flat = [x.reshape(batch * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
        q, k, v, g, beta = (x.new_zeros(int(padded), *x.shape[1:]).index_copy(0, destination, x).unsqueeze(0)
                            for x in flat)
    else:
        pad = (-length) % chunk_size
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
            g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        first_chunks = None
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))  # heads before time
    state = initial_state.float() if initial_state is not None else None
    out, final = _scan(q, k, v, g, beta, chunk_size, first_chunks, state)
    out = out.transpose(1, 2)
    if cu_seqlens is not None:
        out = out[0].index_select(0, destination).reshape(batch, length, heads, -1)
    else:
        out = out[:, :length]
    return out.to(out_dtype), (final if output_final_state else None)


def fla_importable() -> bool:
    """True when flash-linear-attention is installed (never assumed: this project does not install it)."""
    return importlib.util.find_spec("fla") is not None


def gdn_implementation(device_type: str, *, use_triton_gdn: bool = False, use_flash_gdn: bool = False) -> str:
    """Which implementation the flags select on `device_type`: "torch", "triton" or "npu".

    `use_triton_gdn` runs a triton kernel on CUDA (fla's when importable, else ours; see the module docstring),
    and the torch reference elsewhere (triton kernels need a GPU; the log line says which ran). `use_flash_gdn` off
    an NPU is a usage error (it cannot be honoured)."""
    if use_flash_gdn:
        if device_type != "npu":
            raise UsageError(f"optimization.use_flash_gdn: the AscendC Gated DeltaNet ops need an Ascend NPU (this "
                             f"run is on {device_type}) — set it to false (use_triton_gdn on CUDA)")
        return "npu"
    if use_triton_gdn and device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64,
                           scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                           output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None,
                           use_qk_l2norm_in_kernel: bool = False, implementation: str = "torch"
                           ) -> Tuple[Tensor, Optional[Tensor]]:
    """The gated delta rule with the implementation the run chose (see `gdn_implementation`); arguments as
    `chunk_gated_delta_rule_reference`."""
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if implementation == "triton" and q.device.type == "cuda":
        if not fla_importable():
            from kernels.gated_delta_rule_triton import triton_chunk_gated_delta_rule

            return triton_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        return _fla_call(fla_chunk, q, k, v, g, beta, **kwargs)
    if implementation == "npu":
        return _npu_call(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)


def _fla_call(fla_chunk, q, k, v, g, beta, *, cu_seqlens, **kwargs):
    """fla wants one row when packed (cu_seqlens over that row) and q/k heads equal to v heads."""
    batch, length = q.shape[:2]
    heads = v.shape[2]
    if heads != q.shape[2]:
        q, k = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (q, k))
    if cu_seqlens is not None:
        q, k, v, g, beta = (x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu_seqlens = cu_seqlens.long()
    out, state = fla_chunk(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, **kwargs)
    return out.reshape(batch, length, *out.shape[2:]), state


def _npu_call(q, k, v, g, beta, *, chunk_size, cu_seqlens, **kwargs):
    """torch_npu's chunked gated delta rule (the op MindSpeed's `--use-flash-gdn` path calls)."""
    from fsdp2_backend.distributed.device import torch_npu_module

    npu = torch_npu_module()
    op = getattr(npu, "npu_chunk_gated_delta_rule", None) if npu is not None else None
    if op is None:
        raise UsageError("optimization.use_flash_gdn: this torch_npu has no npu_chunk_gated_delta_rule — update "
                         "torch_npu (CANN 8.3+) or turn the flag off")
    batch, length = q.shape[:2]
    if cu_seqlens is not None:
        q, k, v, g, beta = (x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta))
    out, state = op(q, k, v, g=g, beta=beta, chunk_size=chunk_size, cu_seqlens=cu_seqlens, **kwargs)
    return out.reshape(batch, length, *out.shape[2:]), state
