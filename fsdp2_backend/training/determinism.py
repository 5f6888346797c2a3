"""`training.deterministic` (MindSpeed's field, default true; Megatron's --deterministic-mode, default off):
deterministic kernels for reproducible runs.

On: `torch.use_deterministic_algorithms(True, warn_only=True)` (an op without a deterministic kernel warns instead of
stopping the run, as an NPU/GPU run would otherwise fail mid-way on such an op), cuDNN deterministic without
autotuning, cuBLAS' fixed workspace (CUBLAS_WORKSPACE_CONFIG, when unset) and HCCL's deterministic reductions
(HCCL_DETERMINISTIC, when unset). Uninitialised memory is not filled (torch's default under deterministic mode
costs a write per `torch.empty`; this engine reads no uninitialised memory). Off: torch's defaults, as Megatron.
Called once per process, before the process group and any device work.
"""
from __future__ import annotations

import os

import torch


def set_deterministic(enabled: bool) -> None:
    """Switches deterministic algorithms on or off for this process."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("HCCL_DETERMINISTIC", "true")
    if enabled or torch.are_deterministic_algorithms_enabled():
        # the call imports torch._inductor (0.5-1 s of start-up): not made when off and already off (torch's default)
        torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False
