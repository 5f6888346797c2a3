"""Which implementation of an op runs on a device: the NPU kernel, the triton kernel, or the torch reference.

Each op module (`rmsnorm`, `rotary`, ...) says which fast kernels it has; `pick_implementation` chooses by the
device type and what is importable here, and `describe_choice` words the one log line a run prints per flag.
Imports of the optional backends are guarded: torch_npu is probed only when asked about an NPU device, through
the project's one NPU probe (`fsdp2_backend.kernels.npu.torch_npu_module`; importing torch_npu on a
machine without the Ascend toolkit breaks torch), triton only when asked about CUDA.
"""
from __future__ import annotations

import importlib.util

from fsdp2_backend.kernels.npu import npu_available

NPU = "npu"
TRITON = "triton"
TORCH = "torch"


def triton_importable() -> bool:
    """True when the `triton` package is installed and imports."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pick_implementation(device_type: str, *, has_npu_kernel: bool, has_triton_kernel: bool) -> str:
    """NPU kernel on npu (torch_npu sees an NPU), triton kernel on cuda (triton importable), else the torch reference."""
    if device_type == "npu" and has_npu_kernel and npu_available():
        return NPU
    if device_type == "cuda" and has_triton_kernel and triton_importable():
        return TRITON
    return TORCH


def describe_choice(flag: str, device_type: str, implementation: str, detail: str = "") -> str:
    """The log line for one flag, e.g. 'use_fused_rmsnorm: triton kernel on cuda'."""
    if implementation == NPU:
        line = f"{flag}: torch_npu kernel on npu"
    elif implementation == TRITON:
        line = f"{flag}: triton kernel on {device_type}"
    else:
        line = f"{flag}: no fused kernel on {device_type} — running the torch reference"
    return f"{line} ({detail})" if detail else line
