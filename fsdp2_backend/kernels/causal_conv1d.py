"""Depthwise causal conv1d (the short convolution in front of Gated DeltaNet / Mamba mixers), with document
resets for packed sequences.

out[t, c] = act(bias[c] + sum_j weight[c, j] * x[t - (W-1) + j, c]), W the kernel width, taps before the
start of the sequence — or, with `cu_seqlens` (see `kernels/varlen.py`), before the start of t's document —
count as zero, so no token sees the previous document. The math is transformers' `causal_conv1d_fn` fallback
(computed in the weight's dtype, the activation applied, cast back to the input's dtype). Layout: x [B, T, C]
(channels last, as the projections produce it), weight [C, W].

Implementations: "torch" — `F.conv1d` for unpacked rows (what transformers runs), and for packed rows a sum
over the W shifted copies of x with each tap masked where it would cross a document start (W is 4: W cheap
elementwise passes, vectorised over the whole batch). "triton" — `kernels/causal_conv1d_triton.py` (forward and
backward, SiLU fused, the same document resets), on CUDA only; Qwen3-Next's Gated DeltaNet selects it together
with its triton gated delta rule (`use_triton_gdn`: the conv is the first half of the same mixer, so one flag
covers both; see `conv1d_implementation`). On NPU (`use_flash_gdn`) the torch reference's plain tensor ops run:
torch_npu has no documented training causal-conv1d op with document resets.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp2_backend.kernels.varlen import position_ids_from_cu_seqlens

Tensor = torch.Tensor


def _activate(x: Tensor, activation: Optional[str]) -> Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal_conv1d: unsupported activation {activation!r} (silu or None)")


def causal_conv1d_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                            activation: Optional[str] = "silu", cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """The torch reference: x [B, T, C], weight [C, W] → [B, T, C] in x's dtype."""
    batch, length, channels = x.shape
    width = weight.shape[-1]
    h = x.to(weight.dtype)
    if cu_seqlens is None:
        out = F.conv1d(h.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=channels)
        return _activate(out[:, :, :length], activation).transpose(1, 2).to(x.dtype)
    position = position_ids_from_cu_seqlens(cu_seqlens, batch, length).unsqueeze(-1)  # [B, T, 1]
    padded = F.pad(h, (0, 0, width - 1, 0))
    out = torch.zeros_like(h) if bias is None else bias.to(h.dtype).expand_as(h).clone()
    for j in range(width):
        lag = width - 1 - j  # tap j reads the token `lag` steps back, valid while still inside the document
        out = out + (padded[:, j:j + length] * weight[:, j]).masked_fill(position < lag, 0)
    return _activate(out, activation).to(x.dtype)


def conv1d_implementation(device_type: str, gdn_implementation: str = "torch") -> str:
    """The conv's implementation in a Gated DeltaNet mixer whose gated delta rule runs `gdn_implementation`
    (`kernels.gated_delta_rule.gdn_implementation`): "triton" when that is triton on CUDA, else "torch"."""
    return "triton" if gdn_implementation == "triton" and device_type == "cuda" else "torch"


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = "silu",
                  cu_seqlens: Optional[Tensor] = None, implementation: str = "torch") -> Tensor:
    """Depthwise causal conv1d with the implementation for x's device (see the module docstring);
    `implementation` "triton" runs the triton kernels on CUDA tensors (DTensors: the reference)."""
    if implementation == "triton" and x.device.type == "cuda" and \
            not any(isinstance(t, DTensor) for t in (x, weight, bias)):
        from fsdp2_backend.kernels.causal_conv1d_triton import triton_causal_conv1d

        return triton_causal_conv1d(x, weight, bias, activation, cu_seqlens)
    return causal_conv1d_reference(x, weight, bias, activation, cu_seqlens)
