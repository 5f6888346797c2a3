"""Rotary position embedding: the torch reference (Hugging Face's `apply_rotary_pos_emb`, rotate-half form) and
`torch_npu.npu_rotary_mul` on Ascend, behind one dispatcher that picks by the tensor's device.

There is no triton RoPE kernel here (yet): on CUDA the fused path runs the reference. The NPU kernel takes 4-D
tensors with cos/sin broadcastable to them, which is what HF's attention passes after unsqueezing the head dim.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch.distributed.tensor import DTensor

from fsdp2_backend.kernels.npu import torch_npu_module
from fsdp2_backend.kernels.dispatch import NPU, pick_implementation


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim's halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's RoPE: x * cos + rotate_half(x) * sin for q and k, with cos/sin unsqueezed at `unsqueeze_dim`."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_implementation(device_type: str) -> str:
    """What `apply_rotary_pos_emb` runs for tensors on `device_type`: "npu" or "torch"."""
    return pick_implementation(device_type, has_npu_kernel=True, has_triton_kernel=False)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb` signature, with the fused kernel where the device has one."""
    plain = not any(isinstance(t, DTensor) for t in (q, k, cos, sin))
    if plain and q.dim() == 4 and rotary_implementation(q.device.type) == NPU:
        npu = torch_npu_module()
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)
    return apply_rotary_pos_emb_reference(q, k, cos, sin, unsqueeze_dim)
