"""Gated RMSNorm (the SiLU-gated output norm of Mamba-2/3 and Qwen3-Next's Gated DeltaNet): the torch reference,
the triton kernel on CUDA, and a torch_npu composition on Ascend, behind one dispatcher that picks by device.

    rms_norm_gated(x, gate, weight, eps, *, group_size=None, norm_before_gate=True, zero_centered=False)

- `norm_before_gate=True` (Qwen3-Next's `Qwen3NextRMSNormGated`, Mamba-3's output norm):
  y = norm(x) * w * silu(gate).
- `norm_before_gate=False` (transformers' `MambaRMSNormGated`, Mamba-2's norm): y = norm(x * silu(gate)) * w.
- `group_size`: the mean of squares runs over groups of `group_size` channels of the last dim (mamba_ssm's
  `RMSNormGated(group_size=headdim)`, one norm per head); None = the whole last dim.
- `zero_centered`: the weight is stored as an offset from one (w_eff = 1 + weight), as Qwen3-Next's plain norms.
- `gate=None`: plain (grouped) RMSNorm.

Numerics follow transformers' modules: fp32 inside, the normalised value cast to x's dtype before the weight
multiplies it (the HF rounding point), the result returned in x's dtype. The triton kernel
(`rmsnorm_gated_triton`) computes the same; DTensor inputs run the reference (DTensor reduces the weight's
gradient itself). Written here because neither transformers nor torch ships a gated RMSNorm op, and mamba_ssm /
flash-linear-attention (which do) are CUDA-only packages that break a CPU install.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp2_backend.kernels.npu import torch_npu_module
from fsdp2_backend.kernels.dispatch import NPU, TRITON, pick_implementation

# One triton program normalises one group of one row; beyond this width a group no longer fits one block.
MAX_TRITON_GROUP = 65536


def _check(x: torch.Tensor, weight: torch.Tensor, group_size: Optional[int]) -> int:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm_gated: weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    group = hidden if group_size is None else int(group_size)
    if group <= 0 or hidden % group:
        raise ValueError(f"rms_norm_gated: group_size {group_size} does not divide the last dim {hidden}")
    return group


def rms_norm_gated_reference(x: torch.Tensor, gate: Optional[torch.Tensor], weight: torch.Tensor, eps: float, *,
                             group_size: Optional[int] = None, norm_before_gate: bool = True,
                             zero_centered: bool = False) -> torch.Tensor:
    """The gated RMSNorm in plain torch (see the module docstring for the variants)."""
    group = _check(x, weight, group_size)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    g = None if gate is None else F.silu(gate.to(torch.float32))
    if g is not None and not norm_before_gate:
        h = h * g
    grouped = h.unflatten(-1, (-1, group))
    h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    w = (1.0 + weight.to(torch.float32)) if zero_centered else weight
    y = w * h.to(input_dtype)
    if g is not None and norm_before_gate:
        y = y * g
    return y.to(input_dtype)


def rms_norm_gated_implementation(device_type: str) -> str:
    """What `rms_norm_gated` runs for tensors on `device_type`: "npu", "triton" or "torch"."""
    return pick_implementation(device_type, has_npu_kernel=True, has_triton_kernel=True)


def _npu_rms_norm_gated(x, gate, weight, eps, group, norm_before_gate, zero_centered):
    """torch_npu has no gated RMSNorm op: `npu_rms_norm` (one norm per group, so groups become rows) plus the
    gate in torch; the fused rounding differs from the reference only at the input dtype's precision."""
    npu = torch_npu_module()
    h = x
    if gate is not None and not norm_before_gate:
        h = (x.float() * F.silu(gate.float())).to(x.dtype)
    w = (1.0 + weight.float()).to(weight.dtype) if zero_centered else weight
    hidden = x.shape[-1]
    normed = npu.npu_rms_norm(h.reshape(-1, group), torch.ones(group, dtype=x.dtype, device=x.device),
                              epsilon=eps)[0].reshape(x.shape)
    y = normed * w
    if gate is not None and norm_before_gate:
        y = y.float() * F.silu(gate.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], hidden)


def rms_norm_gated(x: torch.Tensor, gate: Optional[torch.Tensor], weight: torch.Tensor, eps: float, *,
                   group_size: Optional[int] = None, norm_before_gate: bool = True,
                   zero_centered: bool = False) -> torch.Tensor:
    """Gated RMSNorm with the fastest implementation for x's device; the reference where none applies."""
    kwargs = dict(group_size=group_size, norm_before_gate=norm_before_gate, zero_centered=zero_centered)
    if any(isinstance(t, DTensor) for t in (x, gate, weight)):
        return rms_norm_gated_reference(x, gate, weight, eps, **kwargs)
    group = _check(x, weight, group_size)
    impl = rms_norm_gated_implementation(x.device.type)
    if impl == NPU:
        return _npu_rms_norm_gated(x, gate, weight, eps, group, norm_before_gate, zero_centered)
    if impl == TRITON and group <= MAX_TRITON_GROUP:
        from fsdp2_backend.kernels.rmsnorm_gated_triton import triton_rms_norm_gated

        return triton_rms_norm_gated(x, gate, weight, eps, **kwargs)
    return rms_norm_gated_reference(x, gate, weight, eps, **kwargs)
