"""RMSNorm: the torch reference (Hugging Face's Qwen3RMSNorm / LlamaRMSNorm math), the triton kernel on CUDA,
and `torch_npu.npu_rms_norm` on Ascend, behind one dispatcher that picks by the tensor's device.

The reference normalises in fp32, casts back to the input dtype, then multiplies by the weight (so the output
dtype is the promotion of the weight's and the input's). The triton kernel (`rmsnorm_triton`) computes the
same in fp32 inside the kernel. DTensor inputs (sequence parallel) run the reference: DTensor dispatches its
ops and reduces the weight's gradient itself, which a raw kernel would bypass.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdp2_backend.kernels.npu import torch_npu_module
from fsdp2_backend.kernels.dispatch import NPU, TRITON, pick_implementation

# One triton program normalises a whole row; beyond this width a row no longer fits one block.
MAX_TRITON_HIDDEN = 65536


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm forward: weight * (x / sqrt(mean(x^2) + eps)), normalised in fp32."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def rms_norm_implementation(device_type: str) -> str:
    """What `rms_norm` runs for tensors on `device_type`: "npu", "triton" or "torch"."""
    return pick_implementation(device_type, has_npu_kernel=True, has_triton_kernel=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the fastest implementation for x's device; the reference where none applies."""
    if isinstance(x, DTensor) or isinstance(weight, DTensor):
        return rms_norm_reference(x, weight, eps)
    impl = rms_norm_implementation(x.device.type)
    if impl == NPU:
        return torch_npu_module().npu_rms_norm(x, weight, epsilon=eps)[0]
    if impl == TRITON and x.shape[-1] <= MAX_TRITON_HIDDEN:
        from fsdp2_backend.kernels.rmsnorm_triton import triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
