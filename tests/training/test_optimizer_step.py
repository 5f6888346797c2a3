"""`training.optimizer_step.OptimizerStep` on one process: the gradient path's order (scale → backward → reduce
hooks → unscale → clip → step → after-step hooks) against a hand-written SGD update, and a non-finite step.

The reference is plain autograd on a copy of the weights (each micro-batch's mean loss over micro-batches, the
gradient clipped by Megatron's rule max / (norm + 1e-6), one SGD step); the hooks record what they saw.
"""
import math

import pytest
import torch
from torch import nn

from fsdp2_backend.training.loss import GlobalBatchLoss
from fsdp2_backend.training.loss_scaler import LossScaler
from fsdp2_backend.training.optimizer_step import OptimizerStep, step_hooks

pytestmark = pytest.mark.unit

LR, MAX_NORM, SCALE, MICRO_BATCHES = 0.3, 0.05, 8.0, 2


class _Increments:
    """The scheduler's side of the step: what it was asked to advance by (a recorder, not the thing under test)."""

    def __init__(self):
        self.calls = []

    def step(self, increment: int) -> None:
        self.calls.append(increment)


def _batches():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(3, 4, generator=gen), torch.randn(3, 1, generator=gen)) for _ in range(MICRO_BATCHES)]


def _model() -> nn.Linear:
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0, 0.25]]))
    return model


def _run(model, batches, scheduler, seen, loss_factor=1.0):
    scaler = LossScaler(dynamic=True, scale=SCALE)
    hooks = step_hooks(model)
    hooks.start["record"] = lambda micro_batches, loss_scale: seen.append(("start", micro_batches, loss_scale))
    hooks.reduce["record"] = lambda: seen.append(("reduce", model.weight.grad.clone()))
    hooks.after_step["a"] = lambda micro_batches: {"first": 1.0}
    hooks.after_step["b"] = lambda micro_batches: {"second": float(micro_batches)}
    hooks.after_step["a"] = lambda micro_batches: {"first": 2.0, "grad": float(model.weight.grad is None)}
    step = OptimizerStep(model, torch.optim.SGD(model.parameters(), lr=LR), scheduler, scaler, MAX_NORM)
    accounting = GlobalBatchLoss(num_microbatches=MICRO_BATCHES, dp_size=1, calculate_per_token_loss=False)
    step.start(MICRO_BATCHES)
    for x, y in batches:
        per_token = (model(x) - y).pow(2).sum(dim=1) * loss_factor
        step.backward(accounting.backward_loss(per_token.sum(), torch.tensor(float(per_token.numel()))))
    step.reduce()
    return step.finish(accounting, MICRO_BATCHES, global_batch_size=12), scaler


def test_the_step_unscales_clips_steps_and_runs_the_hooks_in_order():
    batches, model, seen, scheduler = _batches(), _model(), [], _Increments()
    weight = _model().weight.detach().clone().requires_grad_()
    loss = sum(((x @ weight.T - y).pow(2).sum(dim=1)).mean() for x, y in batches) / MICRO_BATCHES
    loss.backward()
    norm = weight.grad.norm().item()
    expected = weight.detach() - LR * weight.grad * (MAX_NORM / (norm + 1e-6))
    assert MAX_NORM / (norm + 1e-6) < 1  # the clip bites

    outcome, scaler = _run(model, batches, scheduler, seen)
    assert seen[0] == ("start", MICRO_BATCHES, SCALE)
    torch.testing.assert_close(seen[1][1], weight.grad * SCALE)  # reduce hooks see the scaled gradients
    assert outcome.grad_norm == pytest.approx(norm, rel=1e-6)  # the norm of the unscaled gradients
    assert outcome.loss == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(model.weight.detach(), expected)
    assert scheduler.calls == [12] and not outcome.skipped and not outcome.got_nan
    # after-step hooks in registration order ("a" re-registered keeps its place), after zero_grad
    assert list(outcome.logs.items()) == [("first", 2.0), ("grad", 1.0), ("second", float(MICRO_BATCHES))]
    assert model.weight.grad is None and scaler.scale == SCALE


def test_a_non_finite_step_is_skipped_and_still_runs_the_after_step_hooks():
    batches, model, seen, scheduler = _batches(), _model(), [], _Increments()
    before = model.weight.detach().clone()
    outcome, scaler = _run(model, batches, scheduler, seen, loss_factor=math.inf)
    assert outcome.skipped and outcome.got_nan and not math.isfinite(outcome.loss)
    assert torch.equal(model.weight.detach(), before) and scheduler.calls == []
    assert outcome.logs["first"] == 2.0 and model.weight.grad is None
    assert scaler.scale == SCALE  # one overflow: hysteresis 2 keeps the scale
