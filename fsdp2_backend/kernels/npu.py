"""The project's one NPU probe: whether this process can use an Ascend NPU, and torch_npu when it can.

The op library owns it (its NPU paths need it, and it imports nothing of the engine); the engine's device choice
(`distributed/device.py`) and the profiler ask it too. torch_npu is imported on the first call only, never when a
module is imported: an install without the Ascend toolkit breaks torch when imported, and CPU tests must never
load it.
"""
from __future__ import annotations

from functools import lru_cache
from types import ModuleType
from typing import Optional

import torch


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
