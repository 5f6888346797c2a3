"""Grouped GEMM for MoE experts: one matmul per expert over that expert's contiguous run of token rows.

`grouped_linear(x, weight, counts)` computes, for each group e, `x[rows of e] @ weight[e].T` with the rows of
`x` (T, K) laid out group after group (`counts[e]` rows each) and `weight` (E, N, K) stacked per expert.
Backends, picked by `select_backend`:

- ``"npu"``: `torch_npu.npu_grouped_matmul` on Ascend (probed by `fsdp2_backend.kernels.npu`; never
  loaded elsewhere);
- ``"grouped_mm"``: `torch.nn.functional.grouped_mm` (torch >= 2.9; on CPU in 2.13 for any float dtype, on
  CUDA for bf16 on SM >= 80). Its kernels need every non-unit stride and the base address to be multiples of
  16 bytes, and its backward rejects the stride-0 gradients that `.sum()` / `.expand()` produce (and empty
  operands), so we check the layout first and hand it a contiguous gradient;
- ``"loop"``: one `x_e @ w_e.T` per expert; the reference and the fallback for layouts grouped_mm refuses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fsdp2_backend.kernels.npu import torch_npu_module

_ALIGN_BYTES = 16


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    strides_ok = all(s * size % _ALIGN_BYTES == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)
    return strides_ok and t.data_ptr() % _ALIGN_BYTES == 0


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when torch's grouped_mm accepts these operands (API present, rows present, 16-byte strides/addresses)."""
    if not hasattr(F, "grouped_mm") or x.dim() != 2 or weight.dim() != 3:
        return False
    if x.shape[0] == 0:  # an EP rank that receives no tokens: grouped_mm's backward rejects empty operands
        return False
    if x.device.type == "cuda" and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0)):
        return False  # CUDA kernels: bf16 on SM >= 80 only (the CPU kernel takes any float dtype)
    return _aligned(x) and _aligned(weight)


def select_backend(x: torch.Tensor, weight: torch.Tensor, use_grouped_gemm: bool) -> str:
    """The backend `grouped_linear` uses: npu on Ascend, grouped_mm when asked and the layout allows, else loop."""
    if not use_grouped_gemm:
        return "loop"
    if x.device.type == "npu" and torch_npu_module() is not None:
        return "npu"
    return "grouped_mm" if grouped_mm_supported(x, weight) else "loop"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _loop(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    # unbind (not weight[e]) so autograd stacks one gradient for the whole weight instead of E dense ones.
    outs = [xe @ we.t() for xe, we in zip(torch.split(x, counts), weight.unbind(0))]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)
    return _ContiguousGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offs))


class _NpuGroupedLinear(torch.autograd.Function):
    """`npu_grouped_matmul` forward and backward (group_list_type=1: counts; group_type=2 splits K for dW)."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        npu = torch_npu_module()
        group_list = counts.to(device=x.device, dtype=torch.int64)
        ctx.save_for_backward(x, weight, group_list)
        return npu.npu_grouped_matmul([x], [weight.transpose(-2, -1)], group_list=group_list, split_item=3,
                                      group_type=0, group_list_type=1)[0]

    @staticmethod
    def backward(ctx, grad):
        npu = torch_npu_module()
        x, weight, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = npu.npu_grouped_matmul([grad], [weight], group_list=group_list, split_item=3, group_type=0,
                                        group_list_type=1)[0]
        grad_wt = npu.npu_grouped_matmul([x.t()], [grad], group_list=group_list, split_item=3, group_type=2,
                                         group_list_type=1)[0]
        return grad_x, grad_wt.view(weight.shape[0], weight.shape[2], weight.shape[1]).transpose(-2, -1), None


# Eager inside compiled blocks (optimization.torch_compile): the group sizes are data (the loop reads them on the
# host, a graph break), and torch 2.13's meta kernel of grouped_mm refuses the fp32 operands its CPU kernel takes.
@torch.compiler.disable
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   use_grouped_gemm: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """Per-group `x_e @ weight[e].T` for rows of `x` grouped by `counts` (E,) summing to x.shape[0].

    `backend` forces one of "loop", "grouped_mm", "npu"; by default `select_backend` picks.
    """
    x = x.contiguous()
    weight = weight.contiguous()
    backend = backend or select_backend(x, weight, use_grouped_gemm)
    if backend == "grouped_mm":
        return _grouped_mm(x, weight, counts)
    if backend == "npu":
        return _NpuGroupedLinear.apply(x, weight, counts)
    if backend == "loop":
        return _loop(x, weight, counts.tolist())
    raise ValueError(f"unknown grouped GEMM backend {backend!r} (expected loop, grouped_mm or npu)")
