"""The training loop: micro-batches → loss → backward → clip → optimizer/scheduler step, Megatron's way.

Loss semantics (Megatron, via `training.loss.GlobalBatchLoss`): each micro-batch yields the sum of per-token
losses under the loss mask and its token count. Without `calculate_per_token_loss` a micro-batch contributes
sum / count / micro-batches; with it, gradients are divided by the tokens of the whole global batch. FSDP
sums gradients over data-parallel ranks (SUM forced: FSDP2's AVG on gloo can sum, pytorch#162338) and the
1/dp is in the loss, so the result equals a 1-rank run's. The reported `lm loss` is token-weighted over the
global batch.

Context parallel: each rank runs its share of the sequence and a micro-batch's mean runs over the whole
sequence. MoE: the model's weighted aux loss joins the backward loss (not the reported lm loss).
`optimization.chunk_loss_size`: training and validation compute the loss from the final hidden states in chunks
inside the model's forward (`chunked_forward`), with the same sums and counts as the full-logits loss.

An iteration whose loss or gradient norm is not finite is skipped (no update, no scheduler advance) and
counted in "number of skipped iterations" (and in "number of nan iterations" when the loss is not finite),
as Megatron counts them. fp16 uses Megatron's dynamic loss scale (`loss_scaler`).

Checkpoint hooks: `Trainer.state` (a `TrainState`) is what a checkpoint stores besides model, optimizer,
scheduler and loss scaler; `save_hook(trainer, reason)` is called at `save_steps` multiples, at
`exit_interval` and at the end ("interval" / "exit" / "final"); `run_training`'s `resume_hook` restores
everything before the data loaders are built at the restored consumed samples.
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
from usage_errors import UsageError
from fsdp2_backend.training.chunked_forward import check_chunked_loss_model, chunked_loss_forward
from fsdp2_backend.training.exit_conditions import ExitTimer
from fsdp2_backend.training.grad_clip import clip_grad_norm
from fsdp2_backend.training.loss import GlobalBatchLoss, masked_loss_sum
from fsdp2_backend.training.logging import TrainLogger
from fsdp2_backend.training.loss_scaler import LossScaler
from fsdp2_backend.training.profiler import StepProfiler

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
                 valid_batches: Optional[Iterator[Batch]] = None, logger: Optional[TrainLogger] = None,
                 loss_fn: Callable = masked_loss_sum, clip_fn: Callable = clip_grad_norm,
                 profiler: Optional[StepProfiler] = None, save_hook: Optional[Callable] = None,
                 state: Optional[TrainState] = None, loss_scaler: Optional[LossScaler] = None,
                 test_batches: Optional[Iterator[Batch]] = None, start_time: Optional[float] = None,
                 epoch_save_interval: Optional[int] = None):
        self.config, self.ctx, self.model = config, ctx, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_batches, self.valid_batches, self.test_batches = train_batches, valid_batches, test_batches
        self.train_iters, self.micro_batches = train_iters, micro_batches
        self.loss_fn, self.clip_fn = loss_fn, clip_fn
        self.profiler, self.save_hook = profiler, save_hook
        self.epoch_save_interval = epoch_save_interval  # save_epochs, in iterations, when training by epochs
        self.state = state or TrainState()
        self.loss_scaler = loss_scaler or LossScaler.for_dtype(config.parallel.param_dtype)
        self.global_batch_size = micro_batches * config.training.per_device_train_batch_size * ctx.dp_size
        self.logger = logger or TrainLogger(
            train_iters=train_iters, log_interval=config.training.logging_steps,
            global_batch_size=self.global_batch_size, world_size=ctx.world_size, device=ctx.device.torch_device,
            is_logging_rank=ctx.is_last_rank, tokens_per_iteration=self.global_batch_size * config.data.cutoff_len,
            tensorboard_dir=config.training.tensorboard_dir)
        self.device = ctx.device.torch_device
        self.exit_timer = ExitTimer(config.training.exit_duration_in_mins, start=start_time, device=self.device)
        self.loss_group = ctx.loss_mesh.get_group()
        self.cp_size = ctx.cp_mesh.size()
        self.chunk_loss_size = config.optimization.chunk_loss_size  # when set, `loss_fn` is not used
        if self.chunk_loss_size:
            check_chunked_loss_model(model)
        enable_sum_gradient_reduction(model)

    # -- one iteration -------------------------------------------------------------------------------------
    def _forward_loss(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(sum of masked per-token losses, number of loss tokens, weighted MoE aux loss or None) of one
        micro-batch on this rank (its share of the sequence under context parallel)."""
        batch = {("input_ids" if k == "tokens" else k): v.to(self.device, non_blocking=True)
                 for k, v in batch.items() if torch.is_tensor(v)}
        if self.cp_size > 1:
            from fsdp2_backend.parallel.context_parallel.batch import shard_batch_for_cp

            batch = shard_batch_for_cp(batch, self.ctx.cp_mesh.get_local_rank(), self.cp_size,
                                       self.config.parallel.cp_type)
        if self.chunk_loss_size:  # the loss from the hidden states, chunk by chunk, inside the root's forward
            loss_sum, count, aux = chunked_loss_forward(self.model, batch["input_ids"], batch.get("position_ids"),
                                                        batch["labels"], batch["loss_mask"], self.chunk_loss_size)
        else:
            out = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False)
            loss_sum, count = self.loss_fn(out.logits, batch["labels"], batch["loss_mask"])
            aux = getattr(out, "aux_loss", None)  # MoE load balancing (HF: with config.output_router_logits)
        if aux is not None:
            aux = aux * getattr(self.model, "router_aux_loss_coef", self.model.config.router_aux_loss_coef)
        return loss_sum, count, aux

    def _sequence_share(self, count: torch.Tensor) -> torch.Tensor:
        """Under context parallel a micro-batch's mean runs over the whole sequence: this rank's tokens over
        all cp ranks' tokens, times cp (GlobalBatchLoss divides by dp x cp, the sequence's ranks SUM)."""
        if self.cp_size == 1 or self.config.training.calculate_per_token_loss:
            return torch.ones((), device=self.device)
        total = count.detach().float().clone()
        dist.all_reduce(total, group=self.ctx.cp_mesh.get_group())
        return count.detach().float() * self.cp_size / total.clamp(min=1)

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
            loss_sum, count, aux = self._forward_loss(batch)
            scaled = accounting.backward_loss(loss_sum, count) * self._sequence_share(count)
            if aux is not None:  # Megatron adds it to the backward loss, averaged like the lm loss
                scaled = scaled + aux / (self.micro_batches * self.ctx.loss_mesh.size())
            (scaled * self.loss_scaler.scale).backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        loss = accounting.finish(params)
        grad_norm = self._unscale_and_clip(params)
        non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.loss_scaler.update(non_finite)
        if not non_finite:
            self.optimizer.step()
            self.scheduler.step(self.global_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        # Megatron: a skipped iteration is a nan iteration when its loss is not finite (an fp16 overflow in
        # the gradients alone is skipped but not nan).
        return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, skipped=non_finite,
                          got_nan=not math.isfinite(loss))

    def _unscale_and_clip(self, params) -> float:
        if self.loss_scaler.scale != 1.0:
            torch._foreach_div_([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params],
                                self.loss_scaler.scale)
        return float(self.clip_fn(params, self.config.training.max_grad_norm))

    # -- validation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: Optional[Iterator[Batch]] = None) -> float:
        """Token-weighted loss over `eval_iters` global batches of the validation split (or `batches`)."""
        self.model.eval()
        batches = self.valid_batches if batches is None else batches
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for _ in range(self.config.training.eval_iters):
            for _ in range(self.micro_batches):
                loss_sum, count, _ = self._forward_loss(next(batches))
                totals += torch.stack([loss_sum.double(), count.double()])
            self.state.consumed_valid_samples += self.global_batch_size
        self._all_reduce(totals)
        return (totals[0] / totals[1].clamp(min=1)).item()

    # -- the loop ------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Iterates to `train_iters` (or `exit_interval`); logs, validates, profiles and calls the save hook."""
        training = self.config.training
        result = TrainResult(state=self.state)
        exited = False
        while self.state.iteration < self.train_iters:
            step = self.train_step()
            self.state.iteration += 1
            iteration = self.state.iteration
            self.state.consumed_train_samples += self.global_batch_size
            self.state.skipped_iterations += int(step.skipped)
            self.state.nan_iterations += int(step.got_nan)
            lr = self.optimizer.param_groups[0]["lr"]
            result.losses.append(step.loss)
            result.grad_norms.append(step.grad_norm)
            result.learning_rates.append(lr)
            result.skipped.append(step.skipped)
            self.logger.record(iteration, losses={"lm loss": step.loss}, skipped=step.skipped, learning_rate=lr,
                               grad_norm=step.grad_norm, consumed_samples=self.state.consumed_train_samples,
                               loss_scale=self.loss_scaler.scale)
            if self.profiler is not None:
                self.profiler.step(iteration)
            if training.eval_interval and iteration % training.eval_interval == 0 and self.valid_batches:
                result.valid_losses.append((iteration, self._validate(iteration)))
            if self.save_hook is not None and self._save_due(iteration):
                self._save("interval")
            if self.exit_timer.should_exit() or (training.exit_interval and iteration % training.exit_interval == 0):
                self._save("exit")
                exited = True
                break
        if not exited:
            self._save("final")
            # Megatron's end of training: one more evaluation on the validation set, then on the test set.
            if training.eval_interval and training.eval_iters > 0:
                if self.valid_batches:
                    result.valid_losses.append((self.state.iteration,
                                                self._validate(self.state.iteration, split="validation set")))
                if self.test_batches:
                    self._validate(self.state.iteration, split="test set")
        if self.profiler is not None:
            self.profiler.close()
        self.logger.close()
        return result

    def _save_due(self, iteration: int) -> bool:
        """Every save_steps iterations, and every save_epochs epochs when training by epochs."""
        steps, epochs = self.config.training.save_steps, self.epoch_save_interval
        return bool((steps and iteration % steps == 0) or (epochs and iteration % epochs == 0))

    def _validate(self, iteration: int, split: str = "") -> float:
        with self.logger.paused():
            loss = self.evaluate(self.test_batches if split == "test set" else self.valid_batches)
            self.logger.validation(iteration, {"lm loss": loss}, self.state.consumed_valid_samples, split)
        return loss

    def _save(self, reason: str) -> None:
        if self.save_hook is not None:
            with self.logger.paused():
                self.save_hook(self, reason)


# -- assembly: Config → everything above → TrainResult -----------------------------------------------------
def _decline_unsupported(config: Config) -> None:
    problems = []
    if config.training.stage != "pt" or config.data.data_manager_type != "mg":
        problems.append(f"training.stage / data.data_manager_type: '{config.training.stage}' / "
                        f"'{config.data.data_manager_type}' — only pretraining (stage pt, data_manager_type mg) is "
                        f"available in this version; SFT comes later")
    chunk = config.optimization.chunk_loss_size
    if chunk is not None and chunk <= 0:
        problems.append(f"optimization.chunk_loss_size: {chunk} is not a positive number of tokens — give a "
                        f"positive chunk size or leave it unset")
    if chunk and config.parallel.tp_size > 1:
        problems.append("optimization.chunk_loss_size: not available with tensor parallel (parallel.tp_size "
                        f"{config.parallel.tp_size}) yet — unset chunk_loss_size or use tp_size 1")
    if problems:
        raise UsageError(problems)


def seed_everything(seed: int) -> None:
    """Python, numpy and torch RNGs (Megatron's --seed; every rank the same: the data order is the sampler's)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train_length(config: Config, global_batch_size: int, build_data: Callable) -> Tuple[int, Optional[int]]:
    """(train_iters, iterations per epoch or None). Megatron's length: max_steps (--train-iters),
    train_samples // gbs, or num_train_epochs of the train split (its one-epoch sample count read from a
    one-iteration build); only that last way knows an epoch's length."""
    training = config.training
    if training.max_steps and training.max_steps > 0:
        return training.max_steps, None
    if training.train_samples:
        return training.train_samples // global_batch_size, None
    epoch_samples = len(build_data(1).datasets[0] or ())
    iters = int(training.num_train_epochs * epoch_samples) // global_batch_size
    if iters < 1:
        raise UsageError(f"training.num_train_epochs: {training.num_train_epochs} epochs of {epoch_samples} samples "
                         f"make no global batch of {global_batch_size} — train longer or set max_steps")
    return iters, max(epoch_samples // global_batch_size, 1)


def run_training(config: Config, save_hook: Optional[Callable] = None,
                 resume_hook: Optional[Callable] = None) -> TrainResult:
    """Trains per `config` (validated) on this process's rank; the entry point of pretrain_fsdp2.py.

    Checkpoint call sites: `resume_hook(model=, optimizer=, scheduler=, state=, loss_scaler=, tokenizer=)`
    runs once everything is built and before the data is (it may restore all of them in place; the loaders
    then start at `state.consumed_train_samples`); `save_hook(trainer, reason)` as in `Trainer`.
    """
    from fsdp2_backend.data.pretrain import build_pretrain_data, data_iterator
    from fsdp2_backend.models.setup import setup_model_and_tokenizer
    from fsdp2_backend.training.optimizer import build_optimizer
    from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps

    start_time = time.time()  # Megatron's --exit-duration-in-mins counts from the start of the run
    _decline_unsupported(config)
    ctx = ParallelContext.create(config.parallel)
    try:
        training = config.training
        seed_everything(training.seed)
        bundle = setup_model_and_tokenizer(config, ctx)
        mbs, micro_batches = training.per_device_train_batch_size, training.gradient_accumulation_steps
        gbs = mbs * micro_batches * ctx.dp_size
        state = TrainState()

        def build_data(iters: int):
            return build_pretrain_data(config, bundle.tokenizer, ctx.dp_rank, ctx.dp_size,
                                       state.consumed_train_samples, gbs, mbs, iters,
                                       consumed_valid_samples=state.consumed_valid_samples)

        train_iters, epoch_iters = _train_length(config, gbs, build_data)
        optimizer = build_optimizer(bundle.model, name=training.optimizer, lr=training.lr,
                                    weight_decay=training.weight_decay,
                                    betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_epsilon,
                                    decoupled_lr=training.decoupled_lr, decoupled_min_lr=training.decoupled_min_lr,
                                    apply_wd_to_qk_layernorm=training.apply_wd_to_qk_layernorm)
        scheduler = ParamScheduler(optimizer, **scheduler_steps(training, gbs, train_iters))
        loss_scaler = LossScaler.for_dtype(config.parallel.param_dtype)
        if resume_hook is not None:
            resume_hook(model=bundle.model, optimizer=optimizer, scheduler=scheduler, state=state,
                        loss_scaler=loss_scaler, tokenizer=bundle.tokenizer)
        data = build_data(train_iters)
        if data.train_loader is None:
            raise UsageError("data.dataset: the training split is empty — check data.split and the data paths")
        profiler = StepProfiler(config.profiling, rank=ctx.rank, device_type=ctx.device.type,
                                first_iteration=state.iteration) if config.profiling.profile else None
        trainer = Trainer(config, ctx, bundle.model, optimizer, scheduler,
                          data_iterator(data.train_loader, config.data.dataloader_type), train_iters,
                          micro_batches=micro_batches,
                          valid_batches=data_iterator(data.valid_loader, config.data.dataloader_type),
                          test_batches=data_iterator(data.test_loader, config.data.dataloader_type),
                          profiler=profiler, save_hook=save_hook, state=state, loss_scaler=loss_scaler,
                          start_time=start_time,
                          epoch_save_interval=epoch_iters * training.save_epochs if epoch_iters else None)
        return trainer.train()
    finally:
        ctx.close()
