"""The training loop: micro-batches → loss → backward → clip → optimizer/scheduler step, Megatron's way.

Loss semantics (Megatron, via `training.loss.GlobalBatchLoss`): each micro-batch yields the sum of per-token
losses under the loss mask and its token count. Without `calculate_per_token_loss` a micro-batch contributes
sum / count / micro-batches; with it, gradients are divided by the tokens of the whole global batch. FSDP
sums gradients over data-parallel ranks (SUM forced: FSDP2's AVG on gloo can sum, pytorch#162338) and the
1/dp is in the loss, so the result equals a 1-rank run's; the parameters FSDP leaves whole on every rank
(`parallel.ignored_modules`) get the same SUM after the last backward (`parallel.replicated_grads`). The reported
`lm loss` is token-weighted over the global batch.

Context parallel: each rank runs its share of the sequence and a micro-batch's mean runs over the whole
sequence. MoE: the model's weighted aux loss joins the backward loss (not the reported lm loss); so does the DSA
indexer's KL loss (models/dsa_indexer_loss.py, logged as "indexer loss").
`optimization.chunk_loss_size`: training and validation compute the loss from the final hidden states in chunks
inside the model's forward (`chunked_forward`), with the same sums and counts as the full-logits loss.

An iteration whose loss or gradient norm is not finite is skipped (no update, no scheduler advance) and
counted in "number of skipped iterations", and in "number of nan iterations" when the loss, or (without fp16's
dynamic loss scale, whose overflows are expected) the gradient norm, is not finite. With
`check_for_nan_in_loss_and_grad` (Megatron's default) such an iteration stops the run (`RunStopped`: one line,
exit 1) after its log line: nothing is saved or exported after it. fp16 uses Megatron's dynamic loss scale
(`loss_scaler`). The gradient path after the forward (scale, backward, reduce, unscale, clip, finite check,
optimizer and scheduler step, the after-step hooks the plan registered) is `training.optimizer_step`'s; the
trainer knows no model internals. `exit_signal_handler`: after the iteration in which the signal arrived, save and exit
(`exit_signal`).

The trainer runs the loop over a `build.TrainJob` and nothing else: assembly (model, data, resume) is
`fsdp2_backend.build`'s. Checkpoints: the job's checkpointer saves at `save_steps` multiples (0: none), at
`exit_interval` and at the end ("interval" / "exit" / "final").
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from fsdp2_backend.training.chunked_forward import check_chunked_loss_model, chunked_loss_forward
from fsdp2_backend.training.exit_conditions import ExitTimer
from fsdp2_backend.training.exit_signal import ExitSignal
from fsdp2_backend.usage_errors import RunStopped, UsageError
from fsdp2_backend.training.grad_clip import clip_grad_norm
from fsdp2_backend.training.compiled_loss import compiled_masked_loss_sum
from fsdp2_backend.training.loss import GlobalBatchLoss, masked_loss_sum
from fsdp2_backend.training.logging import TrainLogger
from fsdp2_backend.training.loss_scaler import LossScaler
from fsdp2_backend.training.mtp_loss import MTPLoss
from fsdp2_backend.training.optimizer_step import OptimizerStep

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
    # the after-step hooks' log values, Megatron's names: load_balancing_loss, z_loss, indexer loss, mtp_1 loss, ...
    extra_losses: Dict[str, float] = field(default_factory=dict)
    global_batch_size: int = 0  # the samples this step consumed (changes under a batch-size ramp-up)


@dataclass
class TrainResult:
    """What `run_training` returns: per-step figures (for tests and tools) and the final state."""

    losses: List[float] = field(default_factory=list)
    grad_norms: List[float] = field(default_factory=list)
    learning_rates: List[float] = field(default_factory=list)
    skipped: List[bool] = field(default_factory=list)
    valid_losses: List[Tuple[int, float]] = field(default_factory=list)
    state: TrainState = field(default_factory=TrainState)


class Trainer:
    """Runs iterations over `train_batches` (this rank's micro-batches, in order) until `train_iters`."""

    def __init__(self, job):
        config, ctx, model = job.config, job.ctx, job.model
        self.job, self.config, self.ctx, self.model = job, config, ctx, model
        self.optimizer, self.scheduler = job.optimizer, job.scheduler
        self.train_batches, self.valid_batches, self.test_batches = (job.train_batches, job.valid_batches,
                                                                     job.test_batches)
        self.train_iters, self.micro_batches = job.train_iters, job.micro_batches
        # optimization.torch_compile: the loss head compiled too, one kernel forward and one backward that writes
        # the logits' gradient over the logits (training/compiled_loss.py)
        loss_fn = compiled_masked_loss_sum if config.optimization.torch_compile else masked_loss_sum
        self.loss_fn = job.loss_fn or loss_fn
        self.profiler, self.checkpointer = job.profiler, job.checkpointer
        self.epoch_save_interval = job.epoch_save_interval
        self.state = job.state if job.state is not None else TrainState()
        self.loss_scaler = job.loss_scaler or LossScaler.for_dtype(config.parallel.param_dtype)
        self.global_batch_size = self.micro_batches * config.training.per_device_train_batch_size * ctx.dp_size
        self.logger = job.logger or TrainLogger(
            train_iters=self.train_iters, log_interval=config.training.logging_steps,
            global_batch_size=self.global_batch_size, world_size=ctx.world_size, device=ctx.device.torch_device,
            is_logging_rank=ctx.is_last_rank, tokens_per_iteration=self.global_batch_size * config.data.cutoff_len,
            tensorboard_dir=config.training.tensorboard_dir)
        self.device = ctx.device.torch_device
        self.exit_timer = ExitTimer(config.training.exit_duration_in_mins, start=job.start_time, device=self.device)
        self.exit_signal = ExitSignal(config.training.exit_signal_handler, config.training.exit_signal,
                                      device=self.device)
        self.loss_group = ctx.loss_mesh.get_group()
        self.cp_size = ctx.cp_mesh.size()
        self.chunk_loss_size = config.optimization.chunk_loss_size  # when set, `loss_fn` is not used
        if self.chunk_loss_size:
            check_chunked_loss_model(model)
        self.batch_schedule = getattr(job, "batch_schedule", None)  # config/batch_schedule.py
        # the gradient path, with the hooks the plan registered on the model (routers, indexer loss, replicated
        # gradients) and the trainer's own MTP means (multi-token prediction: training/mtp_loss.py)
        self.optimizer_step = OptimizerStep(model, self.optimizer, self.scheduler, self.loss_scaler,
                                            config.training.max_grad_norm, job.clip_fn or clip_grad_norm)
        self.mtp = (MTPLoss(config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor, ctx)
                    if config.model.mtp_num_layers else None)
        if self.mtp is not None:
            self.optimizer_step.hooks.after_step["mtp"] = self.mtp.finish

    # -- one iteration -------------------------------------------------------------------------------------
    def _forward_loss(self, batch: Batch, accounting: Optional[GlobalBatchLoss] = None,
                      ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(sum of masked per-token losses, number of loss tokens, weighted MoE aux loss or None) of one
        micro-batch on this rank (its share of the sequence under context parallel). With `accounting` (training)
        and MTP, the MTP term rides on the logits' backward and the depths' means are recorded."""
        batch = {("input_ids" if k == "tokens" else k): v.to(self.device, non_blocking=True)
                 for k, v in batch.items() if torch.is_tensor(v)}
        mtp = {}
        if self.mtp is not None and accounting is not None:  # rolled on the whole sequence, before any cp split
            mtp = self.mtp.rolled(batch)
        if self.cp_size > 1:
            from fsdp2_backend.parallel.context_parallel.batch import sequence_indices, shard_batch_for_cp

            seq_len, cp_rank = batch["input_ids"].shape[1], self.ctx.cp_mesh.get_local_rank()
            batch = shard_batch_for_cp(batch, cp_rank, self.cp_size, self.config.parallel.cp_type)
            if mtp:
                index = sequence_indices(seq_len, cp_rank, self.cp_size, self.config.parallel.cp_type,
                                         device=self.device)
                mtp = {k: v.index_select(1, index) for k, v in mtp.items()}
        if mtp:  # the MTP depths' loss rides on the logits' backward
            out = self.mtp.forward(self.model, {**batch, **mtp}, accounting, self.loss_scaler.scale)
            loss_sum, count = self.loss_fn(out.logits, batch["labels"], batch["loss_mask"])
            aux = getattr(out, "aux_loss", None)
        elif self.chunk_loss_size:  # the loss from the hidden states, chunk by chunk, inside the root's forward
            loss_sum, count, aux = chunked_loss_forward(self.model, batch["input_ids"], batch.get("position_ids"),
                                                        batch["labels"], batch["loss_mask"], self.chunk_loss_size)
        else:
            out = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False)
            loss_sum, count = self.loss_fn(out.logits, batch["labels"], batch["loss_mask"])
            aux = getattr(out, "aux_loss", None)  # MoE load balancing (HF: with config.output_router_logits)
        if aux is not None:
            aux = aux * self._aux_loss_coef()
        return loss_sum, count, aux

    def _aux_loss_coef(self) -> float:
        """HF's weight of the returned aux loss: the model's own (an HF MoE model's attribute) else its config's.
        Our routers return Megatron's losses already weighted; their models set the attribute to 1."""
        coef = getattr(self.model, "router_aux_loss_coef", None)
        return coef if coef is not None else getattr(self.model.config, "router_aux_loss_coef", 1.0)

    def _finish_mtp(self, micro_batches: int) -> Dict[str, float]:
        """The MTP log values of the micro-batches run so far (the after-step hook's; {} without MTP)."""
        return self.mtp.finish(micro_batches) if self.mtp is not None else {}

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.ctx.loss_mesh.size() > 1:
            dist.all_reduce(tensor, group=self.loss_group)
        return tensor

    def step_batch(self) -> Tuple[int, int]:
        """(micro-batches, global batch size) of the next step: fixed, or Megatron's calculator at the consumed
        samples (ramp-up, step schedule, rounding: config/batch_schedule.py), whose consistency check stops the run."""
        if self.batch_schedule is None:
            return self.micro_batches, self.global_batch_size
        consumed = self.state.consumed_train_samples
        problem = self.batch_schedule.inconsistent(consumed)
        if problem:
            raise UsageError(f"training.step_batch_size_schedule: {problem} — change the schedule or the micro batch "
                             f"/ data-parallel size")
        return self.batch_schedule.micro_batches(consumed), self.batch_schedule.running_global_batch_size(consumed)

    def train_step(self) -> StepResult:
        """One global batch: forward/backward of every micro-batch, then clip and (maybe) step."""
        self.model.train()
        micro_batches, global_batch_size = self.step_batch()
        accounting = GlobalBatchLoss(num_microbatches=micro_batches, dp_size=self.ctx.loss_mesh.size(),
                                     calculate_per_token_loss=self.config.training.calculate_per_token_loss,
                                     dp_group=self.loss_group, cp_size=self.cp_size,
                                     cp_group=self.ctx.cp_mesh.get_group())
        tokens = 0
        self.optimizer_step.start(micro_batches)
        self.logger.start_timer("forward-backward")  # Megatron's timer names (--log-timers-to-tensorboard)
        for _ in range(micro_batches):
            batch = next(self.train_batches)
            tokens += batch["tokens"].numel()
            loss_sum, count, aux = self._forward_loss(batch, accounting)
            self.optimizer_step.backward(accounting.backward_loss(loss_sum, count, aux))
        self.optimizer_step.reduce()
        self.logger.stop_timer("forward-backward")
        self.logger.start_timer("optimizer")
        outcome = self.optimizer_step.finish(accounting, micro_batches, global_batch_size)
        self.logger.stop_timer("optimizer")
        return StepResult(loss=outcome.loss, grad_norm=outcome.grad_norm, tokens=tokens, skipped=outcome.skipped,
                          got_nan=outcome.got_nan, extra_losses=outcome.logs, global_batch_size=global_batch_size)

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
        micro_batches = self.step_batch()[0]
        while self.state.iteration < self.train_iters:
            # Megatron saves a checkpoint when a ramp-up changes the micro-batches (training.py's loop)
            if self.batch_schedule is not None and self.step_batch()[0] != micro_batches:
                micro_batches = self.step_batch()[0]
                if self.state.iteration and not self._save_due(self.state.iteration):  # not saved just now
                    self._save("interval")
            step = self.train_step()
            self.state.iteration += 1
            iteration = self.state.iteration
            self.state.consumed_train_samples += step.global_batch_size
            if self.batch_schedule is not None:
                self.logger.set_global_batch_size(step.global_batch_size)
            self.state.skipped_iterations += int(step.skipped)
            self.state.nan_iterations += int(step.got_nan)
            lr = self.optimizer.param_groups[0]["lr"]
            result.losses.append(step.loss)
            result.grad_norms.append(step.grad_norm)
            result.learning_rates.append(lr)
            result.skipped.append(step.skipped)
            self.logger.record(iteration, losses={"lm loss": step.loss, **step.extra_losses},
                               skipped=step.skipped, learning_rate=lr, grad_norm=step.grad_norm,
                               consumed_samples=self.state.consumed_train_samples,
                               loss_scale=self.loss_scaler.scale, got_nan=step.got_nan)
            if step.got_nan and training.check_for_nan_in_loss_and_grad:
                self._stop_on_nan(iteration, step)
            if self.profiler is not None:
                self.profiler.step(iteration)
            if training.eval_interval and iteration % training.eval_interval == 0 and self.valid_batches:
                result.valid_losses.append((iteration, self._validate(iteration)))
            sft_evaluate = getattr(self.job, "evaluate", None)  # SFT evaluation sets (data/sft/job_data.py)
            if sft_evaluate and training.eval_interval and iteration % training.eval_interval == 0:
                result.valid_losses += [(iteration, loss) for loss in sft_evaluate(self).values()]
            if self._save_due(iteration):
                self._save("interval")
            if self.exit_timer.should_exit() or (training.exit_interval and iteration % training.exit_interval == 0):
                self._save("exit")
                exited = True
                break
            if self.exit_signal.should_exit():  # Megatron's --exit-signal-handler: save, then leave
                self._save("exit")
                if self.ctx.rank == 0:
                    print(f"exiting program after receiving {self.exit_signal.signal.name} (checkpoint of "
                          f"iteration {iteration} saved).", flush=True)
                exited = True
                break
        if not exited:
            self._save("final")
            if getattr(self.job, "evaluate", None):  # SFT: every evaluation set once more at the end
                result.valid_losses += [(self.state.iteration, loss) for loss in self.job.evaluate(self, True).values()]
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

    def _stop_on_nan(self, iteration: int, step: StepResult) -> None:
        """Megatron's --check-for-nan-in-loss-and-grad: the run ends here, before any save or export."""
        if self.profiler is not None:
            self.profiler.close()
        self.logger.close()
        what = (f"the loss is {step.loss}" if not math.isfinite(step.loss)
                else f"the gradient norm is {step.grad_norm}")
        last = getattr(self.checkpointer, "last_saved", None)
        kept = (f"the last checkpoint (iteration {last}) is kept" if last is not None
                else "no checkpoint was saved by this run")
        raise RunStopped(f"training.check_for_nan_in_loss_and_grad: iteration {iteration}: {what} — training "
                              f"stopped without saving or exporting ({kept}); lower the learning rate or check the "
                              f"data, or pass --no-check-for-nan-in-loss-and-grad to skip such iterations instead")

    def _save_due(self, iteration: int) -> bool:
        """Every save_steps iterations (0: no periodic saves, MindSpeed's meaning), and every save_epochs epochs
        when training by epochs."""
        steps, epochs = self.config.training.save_steps, self.epoch_save_interval
        return bool((steps and iteration % steps == 0) or (epochs and iteration % epochs == 0))

    def _validate(self, iteration: int, split: str = "") -> float:
        with self.logger.paused():
            loss = self.evaluate(self.test_batches if split == "test set" else self.valid_batches)
            self.logger.validation(iteration, {"lm loss": loss}, self.state.consumed_valid_samples, split)
        return loss

    def _save(self, reason: str) -> None:
        if self.checkpointer is not None:
            with self.logger.paused():
                self.checkpointer.save(self.state.iteration, reason, self.train_iters)
            self.logger.checkpoint_saved(self.state.iteration)  # --log-progress
