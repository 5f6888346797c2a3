"""The gradient path of one training step, in one fixed order, and the hooks other parts register on it.

    start(micro_batches)     start hooks learn the step's loss scale and micro-batches (the DSA indexer loss's
                             backward scale)
    backward(loss)           per micro-batch: loss x the loss scale (fp16's dynamic scale, else 1), backward
    reduce()                 reduce hooks: gradients no FSDP unit reduces (replicated parameters)
    finish(accounting, ...)  the global batch's loss (`accounting.finish` normalises the gradients) → unscale
                             (÷ the loss scale) → clip (the global norm, `training.grad_clip`) → finite check →
                             loss-scale update → optimizer and scheduler step (skipped when not finite) → zero
                             gradients → after-step hooks (expert-bias update and MoE log values, the indexer
                             loss's and MTP's log values), whose log values the step returns in registration order

Who registers what: the parallel plan (`parallel.apply`) on the model it returns (`step_hooks(model)`): the MoE
routers' and the DSA indexer loss's hooks (`parallel/loss_hooks.py`, which hands those model-side terms the
reduction functions they need: model code sees no process group) and the replicated gradients' reduction
(`parallel/replicated_grads.py`); the trainer adds the MTP means of its own forward (`training/mtp_loss.py`).
The trainer knows none of these terms, and nothing here knows a model's internals.

The order of operations is the one the trainer always had (results are bit-identical to it: the parity, resume
and compile tests compare runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict

import torch
from torch import nn

from fsdp2_backend.distributed.dtensor import local_tensor
from fsdp2_backend.training.grad_clip import clip_grad_norm
from fsdp2_backend.training.loss_scaler import LossScaler

StartHook = Callable[[int, float], None]               # (micro-batches, loss scale)
ReduceHook = Callable[[], None]
AfterStepHook = Callable[[int], Dict[str, float]]      # (micro-batches) → log values


@dataclass
class StepHooks:
    """Named hooks, run in the order first registered; registering a name again replaces that hook in place (a
    plan applied twice to one model registers each once)."""

    start: Dict[str, StartHook] = field(default_factory=dict)
    reduce: Dict[str, ReduceHook] = field(default_factory=dict)
    after_step: Dict[str, AfterStepHook] = field(default_factory=dict)


_HOOKS = "_optimizer_step_hooks"  # on the model root (a plain attribute: not a module, not state)


def step_hooks(model: nn.Module) -> StepHooks:
    """The hooks registered on `model` (created empty on first use)."""
    hooks = model.__dict__.get(_HOOKS)
    if hooks is None:
        hooks = model.__dict__[_HOOKS] = StepHooks()
    return hooks


@dataclass
class StepOutcome:
    """What `OptimizerStep.finish` found: the global batch's token-weighted loss, the pre-clip gradient norm,
    whether the step was skipped (non-finite loss or norm) or is a nan iteration, and the hooks' log values."""

    loss: float
    grad_norm: float
    skipped: bool
    got_nan: bool
    logs: Dict[str, float]


class OptimizerStep:
    """Owns the gradient path (the module docstring); `hooks` default to those registered on `model`."""

    def __init__(self, model: nn.Module, optimizer, scheduler, loss_scaler: LossScaler, max_grad_norm: float,
                 clip_fn: Callable = clip_grad_norm, hooks: StepHooks = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_scaler, self.max_grad_norm, self.clip_fn = loss_scaler, max_grad_norm, clip_fn
        self.hooks = hooks if hooks is not None else step_hooks(model)

    def start(self, micro_batches: int) -> None:
        for hook in self.hooks.start.values():
            hook(micro_batches, self.loss_scaler.scale)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scaler.scale).backward()

    def reduce(self) -> None:
        """After the last micro-batch's backward: what FSDP's reduce-scatter does not do."""
        for hook in self.hooks.reduce.values():
            hook()

    def finish(self, accounting, micro_batches: int, global_batch_size: int) -> StepOutcome:
        params = [p for p in self.model.parameters() if p.grad is not None]
        loss = accounting.finish(params)
        grad_norm = self._unscale_and_clip(params)
        non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.loss_scaler.update(non_finite)
        if not non_finite:
            self.optimizer.step()
            self.scheduler.step(global_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        logs: Dict[str, float] = {}
        for hook in self.hooks.after_step.values():
            logs.update(hook(micro_batches))
        # A nan iteration: its loss is not finite, or its gradients are without fp16's dynamic loss scale (an fp16
        # overflow in the gradients alone is skipped but not nan: the scale backs off).
        got_nan = not math.isfinite(loss) or (not self.loss_scaler.dynamic and not math.isfinite(grad_norm))
        return StepOutcome(loss=loss, grad_norm=grad_norm, skipped=non_finite, got_nan=got_nan, logs=logs)

    def _unscale_and_clip(self, params) -> float:
        if self.loss_scaler.scale != 1.0:
            torch._foreach_div_([local_tensor(p.grad) for p in params], self.loss_scaler.scale)
        return float(self.clip_fn(params, self.max_grad_norm))
