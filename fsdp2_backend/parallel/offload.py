"""Host-memory offload: FSDP2's parameter / gradient / optimizer-state offload, and whole layers' activations.

- `parallel.cpu_offload` (Megatron `--optimizer-cpu-offload`, MindSpeed's FSDP `cpu_offload`): FSDP2's
  `CPUOffloadPolicy` — the sharded parameters and their gradients live on the host, so the optimizer state
  (created beside the parameters) and the optimizer step do too; FSDP copies each unit to the device for its
  all-gather. Pinned host memory where the device allows (not on a CPU run, where pinning means nothing).
- `parallel.activation_offload_layers` (Megatron `--cpu-offloading-num-layers`): the tensors autograd saves
  inside the first N decoder layers are copied to (pinned) host memory in forward and back to the device when
  backward needs them (`torch.autograd.graph.saved_tensors_hooks`), asynchronously where the memory is pinned.
  Parameters are left alone: they are FSDP's to manage, and copying them would only move weights back and forth.
  The math is untouched: losses equal the run without offload.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import nn


def offload_policy(cpu_offload: bool, device_type: str):
    """The `offload_policy` for `fully_shard` (None: parameters stay on the device)."""
    if not cpu_offload:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors go to host memory in forward and come back to their device in backward; parameters and
    tensors already on the host stay as they are. `packed` counts the tensors kept for backward (tests and
    benchmarks read it)."""

    def __init__(self, pin_memory: bool):
        self.packed = 0

        def pack(tensor: torch.Tensor):
            self.packed += 1
            if isinstance(tensor, nn.Parameter) or tensor.device.type == "cpu":
                return None, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)
            if tensor.is_contiguous():
                host.copy_(tensor, non_blocking=pin_memory)
            else:  # keep the values, not the strides: autograd only reads them
                host.copy_(tensor.contiguous(), non_blocking=pin_memory)
            return tensor.device, host

        def unpack(packed):
            device, tensor = packed
            return tensor if device is None else tensor.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder blocks in order (`model.layers`, or the model's own `layers`)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def apply_activation_offload(model: nn.Module, num_layers: int, device_type: str) -> List[nn.Module]:
    """Runs the forward of the first `num_layers` decoder layers (-1: all) under `HostActivations`; returns the
    layers wrapped. Each wrapped layer's hooks are at `layer.host_activations`."""
    layers = decoder_layers(model)
    chosen = layers if num_layers < 0 else layers[:num_layers]
    for layer in chosen:
        hooks = HostActivations(pin_memory=device_type != "cpu")
        layer.host_activations = hooks
        layer.forward = _under(hooks, layer.forward)
    return chosen


def _under(hooks: HostActivations, forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with hooks:
            return forward(*args, **kwargs)
    return run


def packed_tensors(model: nn.Module) -> Optional[int]:
    """How many saved tensors the offloaded layers have handled so far (None: no layer is offloaded)."""
    counts = [layer.host_activations.packed for layer in decoder_layers(model)
              if hasattr(layer, "host_activations")]
    return sum(counts) if counts else None
