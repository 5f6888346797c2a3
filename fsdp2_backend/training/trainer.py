"""The training loop: micro-batches → loss → backward → clip → optimizer/scheduler step, Megatron's way.

Loss semantics (Megatron, via `training.loss.GlobalBatchLoss`): each micro-batch yields the sum of per-token
losses under the loss mask and its token count. Without `calculate_per_token_loss` a micro-batch contributes
sum / count / micro-batches; with it, gradients are divided by the tokens of the whole global batch. FSDP
sums gradients over data-parallel ranks (SUM forced: FSDP2's AVG on gloo can sum, pytorch#162338) and the
1/dp is in the loss, so the result equals a 1-rank run's. The reported `lm loss` is token-weighted over the
global batch.

An iteration whose loss or gradient norm is not finite is skipped (no update, no scheduler advance) and
counted in "number of skipped iterations" and "number of nan iterations", as Megatron counts them.

Checkpoint hooks: `Trainer.state` (a `TrainState`) is what a checkpoint stores besides model, optimizer and
scheduler; `Trainer.save_hook(trainer, reason)` is called at `save_steps` multiples, at `exit_interval` and
at the end ("interval" / "exit" / "final"); resuming sets `trainer.state` and the data position before
`train()`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp2_backend.config import Config
from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.training.grad_clip import clip_grad_norm
from fsdp2_backend.training.loss import GlobalBatchLoss, masked_loss_sum
from fsdp2_backend.training.loss_scaler import LossScaler

Batch = Dict[str, torch.Tensor]


@dataclass
class TrainState:
    """Progress a checkpoint must carry to resume exactly (Megatron's iteration and consumed samples)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class StepResult:
    """One optimizer step: the global batch's token-weighted loss, the pre-clip gradient norm, the input
    tokens this rank processed, and whether the step was skipped (non-finite loss or gradient norm)."""

    loss: float
    grad_norm: float
    tokens: int
    skipped: bool
    got_nan: bool


@dataclass
class TrainResult:
    """What `run_training` returns: per-step figures (for tests and tools) and the final state."""

    losses: List[float] = field(default_factory=list)
    grad_norms: List[float] = field(default_factory=list)
    learning_rates: List[float] = field(default_factory=list)
    skipped: List[bool] = field(default_factory=list)
    valid_losses: List[Tuple[int, float]] = field(default_factory=list)
    state: TrainState = field(default_factory=TrainState)


def enable_sum_gradient_reduction(model: nn.Module) -> None:
    """Makes every FSDP unit SUM its gradients (no division): the loss carries the 1/dp factor instead."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


class Trainer:
    """Runs iterations over `train_batches` (this rank's micro-batches, in order) until `train_iters`."""

    def __init__(self, config: Config, ctx: ParallelContext, model: nn.Module, optimizer, scheduler,
                 train_batches: Iterator[Batch], train_iters: int, *, micro_batches: int,
                 valid_batches: Optional[Iterator[Batch]] = None, log_fn: Callable,
                 loss_fn: Callable = masked_loss_sum, clip_fn: Callable = clip_grad_norm, profiler=None,
                 save_hook: Optional[Callable] = None):
        self.config, self.ctx, self.model = config, ctx, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_batches, self.valid_batches = train_batches, valid_batches
        self.train_iters, self.micro_batches = train_iters, micro_batches
        self.loss_fn, self.clip_fn, self.log_fn = loss_fn, clip_fn, log_fn
        self.profiler, self.save_hook = profiler, save_hook
        self.state = TrainState()
        self.loss_scaler = LossScaler.for_dtype(config.parallel.param_dtype)
        self.global_batch_size = micro_batches * config.training.per_device_train_batch_size * ctx.dp_size
        self.device = ctx.device.torch_device
        self.loss_group = ctx.loss_mesh.get_group()
        enable_sum_gradient_reduction(model)

    # -- one iteration -------------------------------------------------------------------------------------
    def _forward_loss(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """(sum of masked per-token losses, number of loss tokens) of one micro-batch on this rank."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
        logits = self.model(input_ids=batch["tokens"], position_ids=batch.get("position_ids"),
                            use_cache=False).logits
        return self.loss_fn(logits, batch["labels"], batch["loss_mask"])

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.ctx.loss_mesh.size() > 1:
            dist.all_reduce(tensor, group=self.loss_group)
        return tensor

    def train_step(self) -> StepResult:
        """One global batch: forward/backward of every micro-batch, then clip and (maybe) step."""
        self.model.train()
        accounting = GlobalBatchLoss(num_microbatches=self.micro_batches, dp_size=self.ctx.loss_mesh.size(),
                                     calculate_per_token_loss=self.config.training.calculate_per_token_loss,
                                     dp_group=self.loss_group)
        tokens = 0
        for _ in range(self.micro_batches):
            batch = next(self.train_batches)
            tokens += batch["tokens"].numel()
            loss_sum, count = self._forward_loss(batch)
            (accounting.backward_loss(loss_sum, count) * self.loss_scaler.scale).backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        loss = accounting.finish(params)
        grad_norm = self._unscale_and_clip(params)
        non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.loss_scaler.update(non_finite)
        if not non_finite:
            self.optimizer.step()
            self.scheduler.step(self.global_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, skipped=non_finite, got_nan=non_finite)

    def _unscale_and_clip(self, params) -> float:
        if self.loss_scaler.scale != 1.0:
            torch._foreach_div_([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params],
                                self.loss_scaler.scale)
        return float(self.clip_fn(params, self.config.training.max_grad_norm))

    # -- validation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted loss over `eval_iters` global batches of the validation split."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for _ in range(self.config.training.eval_iters):
            for _ in range(self.micro_batches):
                loss_sum, count = self._forward_loss(next(self.valid_batches))
                totals += torch.stack([loss_sum.double(), count.double()])
            self.state.consumed_valid_samples += self.global_batch_size
        self._all_reduce(totals)
        return (totals[0] / totals[1].clamp(min=1)).item()

    # -- the loop ------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Iterates to `train_iters` (or `exit_interval`); logs, validates, profiles and calls the save hook."""
        training = self.config.training
        result = TrainResult(state=self.state)
        window = _LogWindow()
        while self.state.iteration < self.train_iters:
            if self.profiler is not None:
                self.profiler.step_begin(self.state.iteration)
            step = self.train_step()
            if self.profiler is not None:
                self.profiler.step_end(self.state.iteration)
            self.state.iteration += 1
            self.state.consumed_train_samples += self.global_batch_size
            self.state.skipped_iterations += int(step.skipped)
            self.state.nan_iterations += int(step.got_nan)
            lr = self.optimizer.param_groups[0]["lr"]
            result.losses.append(step.loss)
            result.grad_norms.append(step.grad_norm)
            result.learning_rates.append(lr)
            result.skipped.append(step.skipped)
            window.add(step)
            iteration = self.state.iteration
            if iteration % max(training.logging_steps, 1) == 0:
                self.log_fn(self, window.summary(lr=lr, loss_scale=self.loss_scaler.scale))
                window = _LogWindow()
            if training.eval_interval and iteration % training.eval_interval == 0 and self.valid_batches:
                result.valid_losses.append((iteration, self._validate(f"iteration {iteration}")))
            if training.exit_interval and iteration % training.exit_interval == 0:
                self._save("exit")
                break
            if self.save_hook is not None and training.save_steps and iteration % training.save_steps == 0:
                self._save("interval")
        else:
            if training.eval_interval and self.valid_batches and self.train_iters % training.eval_interval:
                result.valid_losses.append((self.state.iteration, self._validate(
                    f"iteration {self.state.iteration} on validation set")))
            self._save("final")
        if self.profiler is not None:
            self.profiler.finish()
        return result

    def _validate(self, prefix: str) -> float:
        loss = self.evaluate()
        self.log_fn(self, {"validation": prefix, "lm loss": loss})
        return loss

    def _save(self, reason: str) -> None:
        if self.save_hook is not None:
            self.save_hook(self, reason)


class _LogWindow:
    """Megatron's accumulators between two log lines."""

    def __init__(self):
        self.start = time.perf_counter()
        self.loss_sum = 0.0
        self.advanced = self.skipped = self.nan = self.tokens = self.iterations = 0
        self.grad_norm = float("nan")

    def add(self, step: StepResult) -> None:
        self.iterations += 1
        self.tokens += step.tokens
        self.grad_norm = step.grad_norm
        if step.skipped:
            self.skipped += 1
            self.nan += int(step.got_nan)
        else:
            self.advanced += 1
            self.loss_sum += step.loss

    def summary(self, *, lr: float, loss_scale: float) -> dict:
        elapsed = time.perf_counter() - self.start
        return {"elapsed_ms_per_iteration": 1000.0 * elapsed / max(self.iterations, 1),
                "learning_rate": lr, "lm loss": self.loss_sum / max(self.advanced, 1), "loss_scale": loss_scale,
                "grad_norm": self.grad_norm, "skipped_iterations": self.skipped, "nan_iterations": self.nan,
                "tokens_per_second": self.tokens / max(elapsed, 1e-9)}
