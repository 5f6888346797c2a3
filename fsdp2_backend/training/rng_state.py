"""Per-rank RNG states in a checkpoint: python, numpy, torch CPU and the accelerator's generator."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

RNG_DIR = "rng"


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.pt"


def _device_module():
    """The torch module of the current accelerator (torch.cuda, torch.npu, ...), or None on CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.get_device_module(accelerator) if accelerator is not None else None


def capture_rng_state() -> dict[str, Any]:
    """This rank's RNG states as plain values and tensors (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached),
        "torch_cpu": torch.get_rng_state(),
    }
    module = _device_module()
    if module is not None:
        state["device"] = module.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_cpu"])
    module = _device_module()
    if module is not None and "device" in state:
        module.set_rng_state(state["device"])
