"""Which accelerator this process trains on, and which process-group backend goes with it — decided once.

Order: Ascend NPU (only if `torch_npu` imports and reports a device), CUDA, then CPU. The backend follows the
device (hccl / nccl / gloo) unless `--distributed-backend` asks for another that the device can run.
Everything else in the engine reads the resulting `DeviceInfo` instead of branching on the device itself.

`torch_npu_module()` / `npu_available()` are the one NPU probe of the project (kernels, profiler and device
detection all ask it). torch_npu is imported on the first call only, never when a module is imported: an
install without the Ascend toolkit breaks torch when imported, and CPU tests must never load it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Optional

import torch

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


@lru_cache(maxsize=None)
def torch_npu_module() -> Optional[ModuleType]:
    """torch_npu when this process can use an Ascend NPU, else None (probed once, then cached)."""
    # torch_npu is only trusted when it imports and sees a device: an install without the Ascend toolkit
    # either fails to import or reports none.
    try:
        import torch_npu  # noqa: F401  (NPU-only dependency; never installed in CI)
    except Exception:
        return None
    if not (getattr(torch, "npu", None) and torch.npu.is_available()):
        return None
    return torch_npu


def npu_available() -> bool:
    """True when torch_npu imports and reports an NPU (see `torch_npu_module`)."""
    return torch_npu_module() is not None


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
