"""MXFP8 (OCP Microscaling v1.0): quantise, dequantise and the MX GEMM, for quantised training.

Format: E4M3 elements (`torch.float8_e4m3fn`), one E8M0 scale (a power of two, `torch.float8_e8m0fnu`) per
block of 32 consecutive elements along the LAST dim (the GEMM's reduction dim). Scale rule: the spec's (6.3)
X = 2^(floor(log2(amax(block))) - 8), 8 being E4M3's largest exponent; elements are x / X rounded to nearest
even and saturated to ±448 (the floor leaves amax / X in [256, 512), so the top of a block can saturate).

Implementations, picked by the tensor's device (`kernels.dispatch`):
- torch reference: torchao's `mx_formats.mx_tensor.to_mx` / `to_dtype` (FLOOR scales) — the well-kept library
  for the math; the emulated GEMM dequantises both operands and runs a plain matmul, which is what an MX GEMM
  computes up to accumulation order;
- NPU: `torch_npu.npu_dynamic_mx_quant` and `torch_npu.npu_quant_matmul` (MindSpeed-LLM's calls), guarded and
  never run here;
- CUDA with MX hardware (sm100): torchao's `MXTensor` matmul, which calls `torch._scaled_mm` with e8m0 block
  scales. Without that hardware (and on CPU) the emulated path runs: the same values, no speed-up.
No triton kernel of our own: torchao ships the triton MX casts for CUDA, and the emulated cast is torch code.
"""
from __future__ import annotations

from typing import Tuple

import torch

from fsdp2_backend.kernels.npu import torch_npu_module
from fsdp2_backend.kernels.dispatch import NPU, TORCH, pick_implementation

BLOCK = 32
ELEM_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu


def _torchao():
    """torchao's MX helpers (imported on first use: the `quant` extra; its import-time noise is filtered by
    fsdp2_backend.known_noise)."""
    from torchao.prototype.mx_formats import mx_tensor

    return mx_tensor


def mx_hardware(device: torch.device) -> bool:
    """True where a real MXFP8 GEMM exists: CUDA sm100+ (torch._scaled_mm with e8m0 scales)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def mx_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(elements E4M3 of x's shape, scales E8M0 of shape (..., K / 32)) for `x` (..., K), blocks along K."""
    assert x.shape[-1] % BLOCK == 0, f"MX blocks: the last dim {x.shape[-1]} is not a multiple of {BLOCK}"
    x = x.contiguous()
    if pick_implementation(x.device.type, has_npu_kernel=True, has_triton_kernel=False) == NPU:
        npu = torch_npu_module()
        q, scale = npu.npu_dynamic_mx_quant(x, dst_type=ELEM_DTYPE)  # scales may come as (.., K/64, 2); not run here
        return q, scale.view(SCALE_DTYPE).reshape(*x.shape[:-1], x.shape[-1] // BLOCK)
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()  # torchao's cast takes fp32 / bf16
    mx = _torchao()
    scale, q = mx.to_mx(x, ELEM_DTYPE, BLOCK, mx.ScaleCalculationMode.FLOOR)
    return q, scale.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)


def mx_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `q * 2^scale` in `dtype` (the inverse of `mx_quantize` up to its rounding)."""
    return _torchao().to_dtype(q, scale.reshape(-1), ELEM_DTYPE, BLOCK, dtype)


def mx_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x quantised to MXFP8 and back, in x's dtype."""
    return mx_dequantize(*mx_quantize(x), x.dtype)


def mx_mm(a: Tuple[torch.Tensor, torch.Tensor], b: Tuple[torch.Tensor, torch.Tensor],
          out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T for MX operands a = (q, scale) of shape (M, K) and b of shape (N, K), both blocked along K."""
    (aq, ascale), (bq, bscale) = a, b
    device = aq.device
    implementation = pick_implementation(device.type, has_npu_kernel=True, has_triton_kernel=False)
    if implementation == NPU:
        npu = torch_npu_module()
        # The MXFP8 GEMM on Ascend: x1 (M, K) and x2 (K, N) with E8M0 scales per 32 along K; not run here.
        return npu.npu_quant_matmul(aq, bq.t(), bscale.t(), scale_dtype=npu.float8_e8m0fnu, pertoken_scale=ascale,
                                    pertoken_scale_dtype=npu.float8_e8m0fnu, output_dtype=out_dtype,
                                    group_sizes=[0, 0, BLOCK])
    if implementation == TORCH and mx_hardware(device) and out_dtype == torch.bfloat16:
        mx = _torchao()
        from torchao.quantization.quantize_.common import KernelPreference

        def wrap(q, s):
            return mx.MXTensor(q, s, ELEM_DTYPE, BLOCK, out_dtype, KernelPreference.AUTO, None, False)
        return torch.mm(wrap(aq, ascale), wrap(bq, bscale).t())
    # Emulated: dequantise, then one plain GEMM (what the MX GEMM computes, up to accumulation order).
    return mx_dequantize(aq, ascale, out_dtype) @ mx_dequantize(bq, bscale, out_dtype).t()
