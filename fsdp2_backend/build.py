"""The one assembly: a validated Config → a `TrainJob` holding everything the training loop needs.

    build(config):  ParallelContext → seed → tokenizer → model (built, loaded, parallelised by the fixed plan)
                    → optimizer → scheduler → loss scaler → checkpointer (load: resume / finetune)
                    → data (at the restored consumed samples) → logger → profiler

Where the run starts (`fsdp2_backend.checkpoint.resume_point`) is decided first, from the file system alone: a
resumed run takes its model config and tokenizer from the checkpoint (`hf_meta/`) when the config names no model, so
`--load CKPT` needs no architecture flags. The trainer (`training.trainer`) only runs the loop over a TrainJob.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from fsdp2_backend.config import Config
from fsdp2_backend.usage_errors import RunInterrupted


@dataclass
class TrainJob:
    """Everything one run's loop uses. `build(config)` makes it; tests may assemble one by hand."""

    config: Config
    ctx: Any                                  # distributed.context.ParallelContext
    model: Any
    optimizer: Any
    scheduler: Any
    train_batches: Iterator
    train_iters: int
    micro_batches: int
    tokenizer: Any = None
    valid_batches: Optional[Iterator] = None
    test_batches: Optional[Iterator] = None
    state: Any = None                         # training.trainer.TrainState (fresh when None)
    loss_scaler: Any = None                   # training.loss_scaler.LossScaler (by dtype when None)
    checkpointer: Any = None                  # training.checkpointer.Checkpointer, None: no checkpoints
    logger: Any = None                        # training.logging.TrainLogger (Megatron's line when None)
    profiler: Any = None
    loss_fn: Optional[Callable] = None        # training.loss.masked_loss_sum when None
    clip_fn: Optional[Callable] = None        # training.grad_clip.clip_grad_norm when None
    start_time: Optional[float] = None
    epoch_save_interval: Optional[int] = None  # save_epochs in iterations, when training by epochs
    evaluate: Optional[Callable] = None       # SFT: evaluate(trainer, final) → {set: loss}, logs a block per set
    batch_schedule: Any = None                # config.batch_schedule.BatchSizeSchedule: the batch changes per step

    def close(self) -> None:
        """Releases the checkpointer (waits for an async save) and the process group this job created."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.ctx.close()


def seed_everything(seed: int) -> None:
    """Python, numpy and torch RNGs (Megatron's --seed; every rank the same: the data order is the sampler's)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def effective_model_args(config: Config, resume) -> Any:
    """The model arguments the model is built from: a resumed run whose config names no HF directory builds it
    from the checkpoint's own config (and tokenizer, unless one is given); a Megatron-LM checkpoint's model is the
    one its saved args describe. The checkpoint's format says which (`checkpoint.formats`); the weights come from
    the load."""
    if resume.checkpoint is None:
        return config.model
    return resume.format.model_args(config.model, resume.checkpoint)


def build_model(config: Config, ctx, resume):
    """(tokenizer, parallelised model, its HF config): the tokenizer, then the HF config with its vocabulary sized
    for it, then the model through the fixed plan of `parallel.apply`."""
    from fsdp2_backend.models.loading import create_model, load_hf_config, weights_available
    from fsdp2_backend.models.mup import apply_mup
    from fsdp2_backend.data.tokenizer import load_tokenizer, model_vocab_size, new_token_rows
    from fsdp2_backend.parallel.apply import apply_parallelism

    model_args = effective_model_args(config, resume)
    tokenizer = load_tokenizer(model_args)
    hf_config = load_hf_config(model_args)
    if config.training.router_aux_loss_coef is not None:  # MindSpeed's: the MoE model's own aux-loss weight
        hf_config.router_aux_loss_coef = config.training.router_aux_loss_coef
        hf_config.output_router_logits = config.training.router_aux_loss_coef > 0
    from_checkpoint = weights_available(model_args)
    config_vocab = hf_config.vocab_size
    if resume.checkpoint is not None:
        # A resumed run's embedding has the checkpoint's rows (at any tp): its saved config says how many (a
        # Megatron-LM one's padded rows, read from its tensors).
        saved = resume.format.model_config(resume.checkpoint, []) or {}
        config_vocab, from_checkpoint = saved.get("vocab_size", config_vocab), True
    elif not from_checkpoint and config.model.architecture and not config.model.architecture.get("vocab_size"):
        config_vocab = None  # Megatron sizes a from-scratch model by its tokenizer
    hf_config.vocab_size = model_vocab_size(model_args, config_vocab, tokenizer, from_checkpoint=from_checkpoint,
                                            tp_size=ctx.layout.tp)
    model = create_model(model_args, hf_config, seed=config.training.seed, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(*_with_mtp(m, config, model_args), ctx),
                         new_rows=new_token_rows(model_args, tokenizer, config.training.seed))
    apply_mup(model, config.model, hf_config, seed=config.training.seed, initialise=not from_checkpoint)  # µP
    if config.model.mla_scale_q_lora or config.model.mla_scale_kv_lora:  # MindSpeed's MLA latent scales
        from fsdp2_backend.distributed.console import print_rank0
        from fsdp2_backend.models.mla_lora_scale import apply_mla_lora_scales, builtin_note

        note = builtin_note(model, config.model.mla_scale_q_lora, config.model.mla_scale_kv_lora)
        if note:
            print_rank0(note)
        apply_mla_lora_scales(model, config.model.mla_scale_q_lora, config.model.mla_scale_kv_lora)
    return tokenizer, model, hf_config


def _with_mtp(model, config: Config, model_args=None):
    """(model, config) for the parallel plan: with `model.mtp_num_layers`, the MTP layers attached
    (models/mtp.py; their weights from the HF directory when it has them) and made FSDP units (`mtp.layers.{}`
    added to a copy of fsdp_modules)."""
    if not config.model.mtp_num_layers:
        return model, config
    from fsdp2_backend.models.mtp import attach_mtp, load_mtp_weights

    attach_mtp(model, config.model.mtp_num_layers, config.training.seed)
    if model_args is not None and not model_args.train_from_scratch:
        load_mtp_weights(model, model_args.model_name_or_path)
    units = list(config.parallel.fsdp_modules)
    if "mtp.layers.{}" not in units:
        units.append("mtp.layers.{}")
    plan = dict(fsdp_modules=units)
    if config.parallel.ep_size > 1 or config.parallel.ep_fsdp_size > 1:  # the MTP layers' experts: the expert plan
        plan.update(ep_modules=_with_mtp_experts(model, config.parallel.ep_modules),
                    ep_fsdp_modules=_with_mtp_experts(model, config.parallel.ep_fsdp_modules))
    return model, dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **plan))


def _with_mtp_experts(model, patterns):
    """`patterns` plus, for each decoder-layer pattern (`model.layers.{*}.X`), the same module X in the MTP layers
    (`mtp.layers.{*}.transformer_layer.X`) where the MTP layers have it: their experts shard like the main ones."""
    from fsdp2_backend.parallel.plans import unmatched_patterns

    out = list(patterns)
    for pattern in patterns:
        for prefix in ("model.layers.{*}.", "model.layers.{}."):
            if pattern.startswith(prefix):
                mtp = "mtp.layers.{*}.transformer_layer." + pattern[len(prefix):]
                if mtp not in out and not unmatched_patterns(model, [mtp]):
                    out.append(mtp)
    return out


def train_length(config: Config, global_batch_size: int, build_data: Callable, batch_schedule=None):
    """(train_iters, iterations per epoch or None). Megatron's length: max_steps (--train-iters),
    train_samples // gbs (counted step by step under a batch-size ramp-up: `batch_schedule`), or num_train_epochs
    of the train split (its one-epoch sample count read from a one-iteration build); only that last way knows an
    epoch's length."""
    from fsdp2_backend.usage_errors import UsageError

    training = config.training
    if training.max_steps and training.max_steps > 0:
        return training.max_steps, None
    if training.train_samples:
        if batch_schedule is not None:
            return batch_schedule.train_iters(training.train_samples), None
        return training.train_samples // global_batch_size, None
    epoch_samples = len(build_data(1).datasets[0] or ())
    iters = int(training.num_train_epochs * epoch_samples) // global_batch_size
    if iters < 1:
        raise UsageError(f"training.num_train_epochs: {training.num_train_epochs} epochs of {epoch_samples} samples "
                         f"make no global batch of {global_batch_size} — train longer or set max_steps")
    return iters, max(epoch_samples // global_batch_size, 1)


def monitoring_options(config: Config, ctx, model, start_iteration: int,
                       flops_per_iteration: Optional[float]) -> dict:
    """TrainLogger's Megatron extras from the config: scalar intervals and extras, params norm, W&B, progress.txt."""
    from fsdp2_backend.training.metrics_writers import ProgressLog, params_l2_norm
    from fsdp2_backend.training.wandb_writer import wandb_dir

    t = config.training
    wandb_options = None
    if t.wandb_project:
        wandb_options = dict(project=t.wandb_project, exp_name=t.wandb_exp_name, entity=t.wandb_entity,
                             save_dir=wandb_dir(t.wandb_save_dir, t.output_dir), config=dataclasses.asdict(config))
    progress_log = None
    if t.log_progress and t.save_checkpoints and t.output_dir:
        progress_log = ProgressLog(t.output_dir, ctx.world_size, ctx.rank == 0, config.data.cutoff_len,
                                   flops_per_iteration, start_iteration)
    return dict(tensorboard_log_interval=t.tensorboard_log_interval,
                params_norm_fn=(lambda: params_l2_norm(model)) if t.log_params_norm else None,
                log_memory=t.log_memory_to_tensorboard, log_validation_ppl=t.log_validation_ppl_to_tensorboard,
                log_timers=t.log_timers_to_tensorboard, wandb_options=wandb_options, progress_log=progress_log)


def build(config: Config) -> TrainJob:
    """Assembles the run on this process's rank (collective: every rank calls it). `config` is validated."""
    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.data.pretrain import build_pretrain_data, data_iterator
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.checkpoint.resume_point import resume_checkpoint
    from fsdp2_backend.distributed.console import print_rank0
    from fsdp2_backend.config.batch_schedule import schedule_for
    from fsdp2_backend.parallel.float8_delayed import delayed_scaling  # the delayed FP8 recipe's histories, or None
    from fsdp2_backend.training.muon import megatron_muon_options
    from fsdp2_backend.training.checkpointer import Checkpointer
    from fsdp2_backend.training.save_dir_guard import SaveDirGuard
    from fsdp2_backend.training.logging import TrainLogger
    from fsdp2_backend.training.loss_scaler import LossScaler
    from fsdp2_backend.training.optimizer import build_optimizer
    from fsdp2_backend.training.determinism import set_deterministic
    from fsdp2_backend.config.mup_rules import width_mult
    from fsdp2_backend.training.profiler import StepProfiler
    from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps
    from fsdp2_backend.training.throughput import model_flops_per_token
    from fsdp2_backend.training.trainer import TrainState

    start_time = time.time()  # Megatron's --exit-duration-in-mins counts from the start of the run
    training = config.training
    resume = resume_checkpoint(config)  # the same decision validation read the model's facts from
    ctx = ParallelContext.create(config.parallel)
    checkpointer = guard = None
    try:
        # one run per save directory (a lock, also the start-up write probe), before anything is read from it
        guard = SaveDirGuard.acquire(config, ctx.rank, ctx.world_size)
        if resume.reason:
            print_rank0(resume.reason)
        seed_everything(training.seed)
        set_deterministic(training.deterministic)  # MindSpeed's training.deterministic / --deterministic-mode
        tokenizer, model, hf_config = build_model(config, ctx, resume)
        mbs, micro_batches = training.per_device_train_batch_size, training.gradient_accumulation_steps
        gbs = mbs * micro_batches * ctx.dp_size
        batch_schedule = schedule_for(config, ctx.dp_size)  # ramp-up / step schedule / rounding: gbs per step
        if batch_schedule is not None:
            gbs = batch_schedule.global_batch_size  # Megatron's args.global_batch_size (lr schedule, data, eval)
        state = TrainState()

        def build_data(iters: int):
            return build_pretrain_data(config, tokenizer, ctx.dp_rank, ctx.dp_size, state.consumed_train_samples,
                                       gbs, mbs, iters, consumed_valid_samples=state.consumed_valid_samples)

        if config.data.data_manager_type == "lf":  # the fine-tuning data path (data/sft)
            from fsdp2_backend.data.sft.job_data import sft_data_builder

            build_data = sft_data_builder(config, tokenizer, ctx, state)

        train_iters, epoch_iters = train_length(config, gbs, build_data, batch_schedule)
        optimizer = build_optimizer(model, name=training.optimizer, lr=training.lr, weight_decay=training.weight_decay,
                                    betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_epsilon,
                                    decoupled_lr=training.decoupled_lr, decoupled_min_lr=training.decoupled_min_lr,
                                    apply_wd_to_qk_layernorm=training.apply_wd_to_qk_layernorm,
                                    o2=training.o2_optimizer, muon_momentum=training.muon_momentum,
                                    megatron_muon=megatron_muon_options(training), min_lr=training.min_lr,
                                    mup_width_mult=width_mult(config.model, hf_config.hidden_size))
        scheduler = ParamScheduler(optimizer, **scheduler_steps(training, gbs, train_iters))
        loss_scaler = LossScaler.for_dtype(config.parallel.param_dtype)
        checkpointer = Checkpointer(config, resume, states=dict(model=model, optimizer=optimizer, scheduler=scheduler,
                                                                train_state=state, loss_scaler=loss_scaler,
                                                                fp8_delayed=delayed_scaling(model)),
                                    tokenizer=tokenizer, model_config=getattr(model, "config", hf_config), guard=guard)
        checkpointer.load()
        if state.iteration and state.iteration >= train_iters:  # a finished run, run again: nothing to train
            exported = checkpointer.export_if_missing(state.iteration)
            print_rank0(finished_line(resume.checkpoint, state.iteration, train_iters, exported))  # group still up
            raise RunFinished(state)
        data = build_data(train_iters)
        if data.train_loader is None:
            raise UsageError("data.dataset: the training split is empty — check data.split and the data paths")
        tokens_per_iteration = gbs * config.data.cutoff_len
        flops_per_iteration = (model_flops_per_token(hf_config, config.data.cutoff_len) * tokens_per_iteration
                               if training.log_throughput or training.log_progress else None)
        logger = TrainLogger(
            train_iters=train_iters, log_interval=training.logging_steps, global_batch_size=gbs,
            world_size=ctx.world_size, device=ctx.device.torch_device, is_logging_rank=ctx.is_last_rank,
            tokens_per_iteration=tokens_per_iteration, tensorboard_dir=training.tensorboard_dir,
            # MindSpeed's log_throughput: Megatron's TFLOP/s per device (and MFU where the peak is known)
            flops_per_iteration=flops_per_iteration if training.log_throughput else None,
            log_cpu_memory=training.log_cpu_memory, **monitoring_options(config, ctx, model, state.iteration,
                                                                         flops_per_iteration))
        profiler = StepProfiler(config.profiling, rank=ctx.rank, device_type=ctx.device.type,
                                first_iteration=state.iteration) if config.profiling.profile else None
        dataloader_type = config.data.dataloader_type
        return TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=scheduler,
                        train_batches=data_iterator(data.train_loader, dataloader_type), train_iters=train_iters,
                        micro_batches=micro_batches, tokenizer=tokenizer,
                        valid_batches=data_iterator(data.valid_loader, dataloader_type),
                        test_batches=data_iterator(data.test_loader, dataloader_type), state=state,
                        loss_scaler=loss_scaler, checkpointer=checkpointer, logger=logger, profiler=profiler,
                        start_time=start_time, evaluate=getattr(data, "evaluate", None), batch_schedule=batch_schedule,
                        epoch_save_interval=epoch_iters * training.save_epochs if epoch_iters else None)
    except BaseException:
        if checkpointer is not None:
            checkpointer.close()
        elif guard is not None:
            guard.release()
        ctx.close()
        raise


class RunFinished(Exception):
    """Raised by `build` when the checkpoint it resumed from already reaches train_iters (the same command run
    again after it finished): `run_training` says so and returns, nothing trained, saved or exported."""

    def __init__(self, state):
        super().__init__("training already finished")
        self.state = state


def finished_line(checkpoint, iteration: int, train_iters: int, exported: bool) -> str:
    """The one line a finished run's rerun prints (rank 0)."""
    did = "only the missing HF export was written" if exported else "nothing was trained, saved or exported"
    return (f"training already finished: {checkpoint} is iteration {iteration} of {train_iters} (--train-iters / "
            f"training.max_steps) — {did}; raise --train-iters to train further")


def run_training(config: Config):
    """Builds the job, trains it and releases it; the entry point of pretrain_fsdp2.py. Returns the TrainResult."""
    from fsdp2_backend.training.trainer import Trainer, TrainResult

    try:
        job = build(config)
    except RunFinished as done:  # its line is printed
        return TrainResult(state=done.state)
    try:
        trainer = Trainer(job)
        try:
            return trainer.train()
        except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback per rank (usage_errors.RunInterrupted)
            raise RunInterrupted(interrupted_line(config, trainer.state.iteration + 1)) from None  # the one running
    finally:
        job.close()


def interrupted_line(config: Config, iteration: int) -> str:
    """What a user needs after Ctrl-C: where the run stood, its newest checkpoint, and how to go on."""
    from fsdp2_backend.checkpoint.dirs import newest_checkpoint

    t = config.training
    if not (t.save_checkpoints and t.output_dir):
        return f"interrupted at iteration {iteration}; nothing is saved (no --save / training.output_dir)"
    last = newest_checkpoint(t.output_dir)
    if last is None:
        return (f"interrupted at iteration {iteration}; no checkpoint was saved yet, so the same command starts "
                f"again from the beginning")
    return f"interrupted at iteration {iteration}; the last checkpoint is {last.name}; the same command resumes"
