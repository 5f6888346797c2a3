"""The chunked gated delta rule (Gated DeltaNet's linear attention): the torch reference, the triton kernel and
the Ascend op, behind one entry point `chunk_gated_delta_rule` that the model calls.

The recurrence, per head, with state S (K x V), for t = 1..T (q scaled by 1/sqrt(K)):
    S <- exp(g_t) * S;   S <- S + beta_t * k_t (v_t - k_t^T S)^T;   o_t = S^T q_t
The reference computes it chunk by chunk (WY / UT form, as in the Gated DeltaNet paper): one unit-triangular
solve for all chunks, then a loop over chunks (never one per token) of a few matmuls each. Everything runs in
fp32 whatever the input dtype; the output is cast back. The scan is one autograd Function with a hand-written
backward (`kernels/gated_delta_rule_scan.py`: the chunked rule's adjoint, a reverse loop over chunks, both passes
in blocks of chunks so temporaries are sized by the block; autograd through the chunk loop spent as much on
elementwise temporaries as on the matmuls): memory stays linear in the sequence length. transformers' own torch
fallback writes each chunk's output into one preallocated tensor in place, whose backward copies the whole
gradient once per chunk (quadratic).

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

from fsdp2_backend.kernels.gated_delta_rule_scan import chunked_scan, l2_normalize
from fsdp2_backend.usage_errors import UsageError

Tensor = torch.Tensor
IMPLEMENTATIONS = ("torch", "triton", "npu")


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
    state = initial_state.float() if initial_state is not None else None
    out, final = chunked_scan(q, k, v, g, beta, chunk_size, first_chunks, state)
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
            from fsdp2_backend.kernels.gated_delta_rule_triton import triton_chunk_gated_delta_rule

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
    from fsdp2_backend.kernels.npu import torch_npu_module

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
