"""Which implementation runs the Mamba-3 scan: `mamba3_scan` picks the triton forward (`mamba3_scan_triton`) on
cuda, the torch chunked scan (`mamba3_scan_torch`, where the recurrence and its chunked form are described)
elsewhere. Both import the torch scan; only this dispatcher imports the triton one, when it runs it.
"""
from __future__ import annotations

import torch

from fsdp2_backend.kernels.dispatch import TRITON, pick_implementation
from fsdp2_backend.kernels.mamba3_scan_torch import mamba3_chunk_scan

__all__ = ["mamba3_chunk_scan", "mamba3_scan", "mamba3_scan_implementation"]


def mamba3_scan_implementation(device_type: str) -> str:
    """What `mamba3_scan` runs on `device_type`: "triton" (forward kernel, torch backward) on cuda, else "torch"."""
    return pick_implementation(device_type, has_npu_kernel=False, has_triton_kernel=True)


def mamba3_scan(q, k, v, adt, dt, trap, angles, *, chunk_size: int = 64, doc_start=None) -> torch.Tensor:
    """The scan with the fastest implementation for q's device (same arguments and result as
    `mamba3_chunk_scan`): the triton forward on cuda, the torch chunked scan elsewhere (no NPU kernel yet)."""
    if mamba3_scan_implementation(q.device.type) == TRITON:
        from fsdp2_backend.kernels.mamba3_scan_triton import triton_mamba3_chunk_scan

        return triton_mamba3_chunk_scan(q, k, v, adt, dt, trap, angles, chunk_size=chunk_size, doc_start=doc_start)
    return mamba3_chunk_scan(q, k, v, adt, dt, trap, angles, chunk_size=chunk_size, doc_start=doc_start)
