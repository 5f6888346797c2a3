"""Megatron's default FP8 recipe, delayed scaling (`--fp8-recipe delayed`: Transformer Engine's DelayedScaling), for
the FP8 linears of `kernels/float8.py`: owns the amax histories and scales of a model's converted linears, their
quantiser, the update after each step and their checkpoint state.

Each converted linear has three scaled tensors: its input x, its weight w and its output gradient dy (their
transposes in the other GEMMs share the scale). Per tensor, as TE keeps them: an amax history of
`history_len` rows (row 0 is the current step's) and a scale, initially zeros and 1. During a step every
quantisation uses the scale as it stands (`kernels.float8.scaled_quantize`: fp8 values saturate) and records the
tensor's amax; after the optimizer step (`update`, an after-step hook):

    amax history[0] = this step's amax, the maximum over every rank (one all-reduce of all tensors' amaxes)
    amax            = max over the history ("max") or history[0] ("most_recent")
    scale           = 2^(floor(log2(fp8_max / amax)) - margin)   (kept where amax is 0 or not finite)
    history         = rolled by one row, row 0 zeroed   (TE's _update_amax_history)

so a step's scales come from the amaxes of the steps before it (TE's "delayed"). The scale is a power of two, as
Transformer Engine before 1.0 computed it (`_default_sf_compute`: exp = floor(log2(fp8_max / amax)) - margin);
current TE leaves fp8_max / amax / 2^margin unrounded. Why: the layouts' backward passes differ in the last bit
(summation order), so their reduced gradient amaxes differ by ~1e-7, and an unrounded scale moves every product
x · scale by that much, flipping FP8 roundings at random — TP 2 drifted 2e-4 from one process in 4 steps (measured
on tests/parallel/test_float8_tensor_parallel.py's model); a power-of-two scale multiplies exactly, so the FP8
values depend on the elements alone, as in the tensorwise recipe, and the layouts agree. Either scale puts the
tensor's amax within the FP8 range; they differ by less than 2x, i.e. in where the exponent range sits.

The maximum is over the whole world, which is TE's amax reduction group in Megatron (data, tensor and context
parallel ranks): every rank holds the same histories, a tensor-parallel shard is quantised with the whole tensor's
scale, and any layout computes the one-process values. Differences from TE, by design: TE updates after each micro-
batch's forward (its fp8_autocast exit) and backward; here after each step, its amax the maximum over the step's
micro-batches — a data-parallel rank runs fewer micro-batches than one process, so only a per-step update makes the
layouts agree. Amaxes are recorded in training mode only (evaluation leaves the histories alone). `fp8_interval` is
not read (TE >= 1.8 ignores it too).

The state (`state_dict`: names, histories, scales; equal on every rank) is saved with the checkpoint's other
states and loads into any layout (tensor-parallel shards record amaxes but the history is the whole tensor's).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from fsdp2_backend.kernels.float8 import E4M3, E5M2, scaled_quantize

_SLOT = dict(x=0, x_t=0, w=1, w_t=1, dy=2, dy_t=2)  # kernels.float8's operand names → the scaled tensor
ALGOS = ("max", "most_recent")


class DelayedScaling:
    """The delayed-scaling state of a model's FP8 linears `names` (in a fixed order, equal on every rank)."""

    def __init__(self, names: List[str], history_len: int = 1, amax_compute_algo: str = "most_recent",
                 margin: int = 0, grad_format: str = "e4m3"):
        if history_len < 1 or amax_compute_algo not in ALGOS:
            raise ValueError(f"history_len {history_len} (>= 1), amax_compute_algo {amax_compute_algo!r} ({ALGOS})")
        self.names, self.algo, self.margin = list(names), amax_compute_algo, margin
        grad_max = torch.finfo(E5M2 if grad_format == "hybrid" else E4M3).max
        self.fp8_max = torch.tensor([torch.finfo(E4M3).max] * 2 + [grad_max], dtype=torch.float32)
        self.history = torch.zeros(history_len, len(self.names), 3, dtype=torch.float32)
        self.scale = torch.ones(len(self.names), 3, dtype=torch.float32)
        self.amax = torch.zeros(len(self.names), 3, dtype=torch.float32)  # this step's, this rank's

    def _to(self, device: torch.device) -> None:
        if self.scale.device != device:
            self.history, self.scale, self.amax, self.fp8_max = (
                t.to(device) for t in (self.history, self.scale, self.amax, self.fp8_max))

    def quantizer(self, index: int, module: torch.nn.Module) -> "_DelayedQuantizer":
        return _DelayedQuantizer(self, index, module)

    def update(self, group=None) -> None:
        """After a step: this step's amaxes (maximum over the ranks of `group`, default the world) into the
        histories, the new scales, the histories rolled (module docstring)."""
        amax = self.amax
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        self.history[0] = torch.maximum(self.history[0], amax)
        current = self.history.amax(dim=0) if self.algo == "max" else self.history[0].clone()
        # 2^(floor(log2(fp8_max / amax)) - margin): a power of two (module docstring)
        scale = torch.exp2(torch.floor(torch.log2(self.fp8_max.to(current.device) / current)) - self.margin)
        keep = (current <= 0) | ~torch.isfinite(current)
        scale = torch.where(keep, self.scale, scale)
        self.scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
        if self.history.shape[0] > 1:
            self.history = torch.roll(self.history, -1, 0)
        self.history[0] = 0.0
        self.amax = torch.zeros_like(self.amax)

    def after_step(self, micro_batches: int) -> Dict[str, float]:
        """The optimizer step's after-step hook (`training.optimizer_step`): no log values."""
        self.update()
        return {}

    def state_dict(self) -> dict:
        return {"names": list(self.names), "amax_compute_algo": self.algo, "margin": self.margin,
                "amax_history": self.history.cpu().clone(), "scale": self.scale.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        """The saved histories and scales; a checkpoint of other linears or another history length is refused
        (the scales would belong to other tensors)."""
        if list(state["names"]) != self.names or tuple(state["amax_history"].shape) != tuple(self.history.shape):
            raise ValueError(f"the checkpoint's delayed FP8 state holds {len(state['names'])} linears with "
                             f"{state['amax_history'].shape[0]} history rows; this model has {len(self.names)} with "
                             f"{self.history.shape[0]} — resume with the FP8 settings it was saved with")
        device = self.scale.device
        self.history = state["amax_history"].to(device, torch.float32).clone()
        self.scale = state["scale"].to(device, torch.float32).clone()
        self.amax = torch.zeros_like(self.scale)


class _DelayedQuantizer:
    """A `kernels.float8.Quantizer` of one linear: the stored scale, and the operand's amax recorded (training)."""

    def __init__(self, state: DelayedScaling, index: int, module: torch.nn.Module):
        self.state, self.index, self.module = state, index, module

    def __call__(self, name: str, t: torch.Tensor, block: Tuple[int, int], dtype: torch.dtype,
                 pow2: bool) -> torch.Tensor:
        state, slot = self.state, _SLOT[name]
        state._to(t.device)
        if self.module.training and t.numel():
            amax = state.amax[self.index, slot]
            torch.maximum(amax, t.detach().abs().amax().float(), out=amax)
        return scaled_quantize(t, state.scale[self.index, slot], dtype)


_ATTR = "_fp8_delayed_scaling"  # on the model root: a plain attribute (not a module, not part of the state dict)


def attach(model: torch.nn.Module, state: DelayedScaling) -> None:
    model.__dict__[_ATTR] = state


def delayed_scaling(model: torch.nn.Module) -> Optional[DelayedScaling]:
    """The model's delayed-scaling state (for the checkpoint), or None."""
    return model.__dict__.get(_ATTR)
