"""Which accelerator this process trains on, and which process-group backend goes with it — decided once.

Order: Ascend NPU (only if `torch_npu` imports and reports a device), CUDA, then CPU. The backend follows the
device (hccl / nccl / gloo) unless `--distributed-backend` asks for another that the device can run.
Everything else in the engine reads the resulting `DeviceInfo` instead of branching on the device itself.

Whether an NPU is usable is asked of the op library's probe (`kernels/npu.py`, the project's one; kernels and
the profiler ask it too), which imports torch_npu on the first call only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from fsdp2_backend.kernels.npu import npu_available
from fsdp2_backend.usage_errors import UsageError

DEFAULT_BACKEND = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# Backends each device type can run; gloo works for tensors on any host-visible device too, but FSDP2's
# collectives need the device's own backend on accelerators, so only CPU accepts gloo here.
ALLOWED_BACKENDS = {"npu": ("hccl",), "cuda": ("nccl", "gloo"), "cpu": ("gloo",)}


@dataclass(frozen=True)
class DeviceInfo:
    """The device type (npu / cuda / cpu), the backend, and this process's local device index."""

    type: str
    backend: str
    local_rank: int = 0

    @property
    def torch_device(self) -> torch.device:
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, self.local_rank)

    def set_current(self) -> None:
        """Makes this process's device the current one (accelerators only)."""
        if self.type == "cuda":
            torch.cuda.set_device(self.local_rank)
        elif self.type == "npu":
            torch.npu.set_device(self.local_rank)  # registered by torch_npu


def detect_device_type() -> str:
    """'npu', 'cuda' or 'cpu': the first one this process can actually use."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve_device(distributed_backend: Optional[str] = None, device_type: Optional[str] = None,
                   local_rank: Optional[int] = None) -> DeviceInfo:
    """The device and backend for this process; `distributed_backend` None picks the device's default."""
    device_type = device_type or detect_device_type()
    backend = distributed_backend or DEFAULT_BACKEND[device_type]
    if backend not in ALLOWED_BACKENDS[device_type]:
        raise UsageError(f"--distributed-backend (parallel.distributed_backend): '{backend}' cannot run on "
                         f"this machine's {device_type} device — use {' or '.join(ALLOWED_BACKENDS[device_type])}"
                         f" or leave it unset")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DeviceInfo(type=device_type, backend=backend, local_rank=local_rank)
