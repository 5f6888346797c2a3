"""The `training` group of the native configuration (the largest group: schedule, checkpointing, logging, the
optimizer, and the Megatron training meanings the seed lacks). Part of the schema (`config.schema` re-exports
it in `GROUPS`); torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional

from fsdp2_backend.config.fields import help_field


@dataclass
class TrainingArguments:
    """Hyper-parameters, optimizer, saving and logging."""

    output_dir: Optional[str] = help_field(None, "Output directory (checkpoints, logs, exports). Required unless "
                                             "save_checkpoints is false.")
    optimizer: Literal["adamw", "muon", "fused_adamw"] = help_field(
        "adamw", "Optimizer. fused_adamw: AdamW with torch's fused kernel (same update) where the device has one.")
    o2_optimizer: bool = help_field(False, "(MindSpeed) Keep the AdamW moments in bf16 (--o2-optimizer; bf16 training).")
    muon_momentum: float = help_field(0.95, "Muon momentum (Megatron --muon-momentum).")
    muon_scale_mode: Optional[Literal["spectral", "unit_rms_norm", "shape_scaling"]] = help_field(
        None, "(Megatron) Set: Megatron's Muon with this update scale (and the muon_* fields below); unset: "
              "torch.optim.Muon with Moonshot's AdamW-rms lr matching.")
    muon_nesterov: bool = help_field(False, "(Megatron) Nesterov momentum in Megatron's Muon.")
    muon_coefficient_type: Literal["quintic", "simple", "polar_express"] = help_field(
        "quintic", "(Megatron) Newton-Schulz coefficient schedule of Megatron's Muon.")
    muon_num_ns_steps: int = help_field(5, "(Megatron) Newton-Schulz iterations of Megatron's Muon.")
    muon_extra_scale_factor: float = help_field(1.0, "(Megatron) Extra factor on Megatron's Muon update.")
    muon_fp32_matmul_prec: Literal["medium", "high"] = help_field(
        "medium", "(Megatron) Newton-Schulz matmuls of Megatron's Muon: medium bf16, high fp32.")
    lr: float = help_field(1e-5, "Peak learning rate.")
    weight_decay: float = help_field(0.01, "Weight decay (not applied to biases and 1-D parameters).")
    adam_beta1: float = help_field(0.9, "AdamW beta1.")
    adam_beta2: float = help_field(0.95, "AdamW beta2.")
    adam_epsilon: float = help_field(1e-8, "AdamW epsilon.")
    max_grad_norm: float = help_field(1.0, "Gradient clipping norm (0 disables).")
    lr_scheduler_type: Literal["cosine", "linear", "constant", "inverse-square-root", "WSD"] = help_field(
        "cosine", "Learning-rate schedule (Megatron --lr-decay-style).")
    warmup_ratio: float = help_field(0.03, "Fraction of the decay steps spent in linear warmup.")
    min_lr: float = help_field(1e-6, "Minimum learning rate.")
    num_train_epochs: float = help_field(3.0, "Training epochs; max_steps > 0 overrides it.")
    max_steps: int = help_field(-1, "Training steps (Megatron --train-iters); > 0 overrides num_train_epochs.")
    gradient_accumulation_steps: int = help_field(1, "Micro-batches accumulated per optimizer step.")
    disable_shuffling: bool = help_field(False, "Do not shuffle the training set.")
    seed: int = help_field(42, "Random seed.")
    save_steps: int = help_field(500, "Save a checkpoint every this many steps; 0: no periodic saves (MindSpeed's "
                                  "meaning; the final save still happens).")
    save_total_limit: Optional[int] = help_field(3, "Keep at most this many checkpoints (oldest removed).")
    resume_from_checkpoint: Optional[str] = help_field(None, "Checkpoint to resume from.")
    logging_steps: int = help_field(1, "Log every this many steps.")
    stage: Literal["pt", "sft"] = help_field("sft", "Training stage: pt (pretraining) or sft.")
    calculate_per_token_loss: bool = help_field(False, "Scale the loss by the global batch's token count.")
    dataloader_num_workers: int = help_field(0, "Data loader worker processes (0: main process).")
    dataloader_prefetch_factor: Optional[int] = help_field(None, "Batches prefetched per worker.")
    dataloader_pin_memory: bool = help_field(True, "Pin data loader memory.")
    dataloader_persistent_workers: bool = help_field(False, "Keep data loader workers alive between epochs.")
    dataloader_drop_last: bool = help_field(False, "Drop the last incomplete batch.")
    per_device_train_batch_size: int = help_field(8, "Micro-batch size per device (Megatron --micro-batch-size).")
    save_only_model: bool = help_field(False, "Save only the model (no optimizer, scheduler or RNG state).")
    save_async: bool = help_field(False, "Save checkpoints asynchronously.")
    save_epochs: int = help_field(1, "Save every this many epochs (when training by epochs).")
    save_hf_weights: bool = help_field(True, "Export HF weights at the end of training.")
    # MindSpeed-LLM fields the seed's table omits (their YAMLs and launchers set them)
    log_throughput: bool = help_field(False, "(MindSpeed) Show the model's training throughput in the log line "
                                         "(Megatron's 'throughput per GPU (TFLOP/s/GPU)'; Megatron --log-throughput).")
    log_cpu_memory: bool = help_field(False, "(MindSpeed) Show this process's CPU memory (current and peak RSS) in the "
                                         "log line.")
    deterministic: bool = help_field(True, "(MindSpeed) Deterministic algorithms (torch.use_deterministic_algorithms, "
                                       "cuDNN deterministic, HCCL_DETERMINISTIC); Megatron --deterministic-mode.")
    indexer_loss_coeff: Optional[float] = help_field(None, "(MindSpeed) Weight of the DSA lightning indexer's KL "
                                                     "loss (glm52, deepseek_v4); unset: optimization."
                                                     "indexer_loss_coeff (v26.1.0's spelling), else 1.0 (MindSpeed's).")
    router_aux_loss_coef: Optional[float] = help_field(
        None, "(MindSpeed) Weight of the MoE model's own load-balancing loss (its config's router_aux_loss_coef; "
              "0: none); unset: the model config's.")
    mtp_loss_scaling_factor: Optional[float] = help_field(None, "(MindSpeed) Alias of model.mtp_loss_scaling_factor.")
    # Megatron extensions
    save_checkpoints: bool = help_field(True, "(Megatron) False: no checkpoints and no export (a script "
                                          "without --save).")
    global_batch_size: Optional[int] = help_field(None, "(Megatron) --global-batch-size; derives "
                                                    "gradient_accumulation_steps = gbs / (mbs x dp).")
    rampup_batch_size: Optional[List[int]] = help_field(None, "(Megatron) [START, INCREMENT, SAMPLES]: the global batch "
                                                          "grows from START by INCREMENT to global_batch_size over "
                                                          "SAMPLES samples (needs train_samples).")
    step_batch_size_schedule: Optional[str] = help_field(None, "(Megatron) 'TOKENS:GBS ...' (K/M/B/T suffixes): the "
                                                           "global batch from each threshold on (needs train_samples).")
    decrease_batch_size_if_needed: bool = help_field(False, "(Megatron) Round the global batch down to a multiple of "
                                                        "micro batch x data-parallel size.")
    train_samples: Optional[int] = help_field(None, "(Megatron) Train by samples instead of steps.")
    lr_warmup_iters: int = help_field(0, "(Megatron) Warmup iterations (instead of warmup_ratio).")
    lr_warmup_samples: int = help_field(0, "(Megatron) Warmup samples (when training by samples).")
    lr_warmup_init: float = help_field(0.0, "(Megatron) Learning rate at the start of warmup.")
    lr_decay_iters: Optional[int] = help_field(None, "(Megatron) Decay iterations (default: max_steps).")
    lr_decay_samples: Optional[int] = help_field(None, "(Megatron) Decay samples (default: train_samples).")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = help_field(
        "exponential", "(Megatron) Anneal style of the WSD schedule.")
    lr_wsd_decay_iters: Optional[int] = help_field(None, "(Megatron) Anneal iterations of the WSD schedule.")
    lr_wsd_decay_samples: Optional[int] = help_field(None, "(Megatron) Anneal samples of the WSD schedule.")
    exit_interval: Optional[int] = help_field(None, "(Megatron) Stop (after saving) when the iteration is a "
                                                "multiple of this.")
    eval_interval: Optional[int] = help_field(None, "(Megatron) Validate every this many steps; unset: never.")
    eval_iters: int = help_field(100, "(Megatron) Validation iterations per evaluation.")
    no_load_optim: bool = help_field(False, "(Megatron) Do not load the optimizer state on resume.")
    no_load_rng: bool = help_field(False, "(Megatron) Do not load the RNG state on resume.")
    no_save_optim: bool = help_field(False, "(Megatron) Do not save the optimizer state.")
    no_save_rng: bool = help_field(False, "(Megatron) Do not save the RNG state.")
    finetune: bool = help_field(False, "(Megatron) Load model weights only; restart iteration and samples at 0.")
    tensorboard_dir: Optional[str] = help_field(None, "(Megatron) Write TensorBoard scalars here.")
    tensorboard_log_interval: int = help_field(1, "(Megatron) Write the TensorBoard / W&B scalars every this many steps.")
    log_params_norm: bool = help_field(False, "(Megatron) Show the parameters' L2 norm in the log line ('params norm') "
                                          "and as the params-norm scalar.")
    log_memory_to_tensorboard: bool = help_field(False, "(Megatron) Write the device memory scalars (mem-allocated-bytes, "
                                                    "...; CPU: the process's RSS).")
    log_validation_ppl_to_tensorboard: bool = help_field(False, "(Megatron) Write the validation perplexity scalars.")
    log_timers_to_tensorboard: bool = help_field(False, "(Megatron) Write iteration-time, throughput and the phase "
                                                    "timers (forward-backward-time, optimizer-time) as scalars.")
    log_progress: bool = help_field(False, "(Megatron) Append job starts and checkpoint saves, with throughput, to "
                                       "output_dir/progress.txt.")
    wandb_project: Optional[str] = help_field(None, "(Megatron) Log the run to this Weights & Biases project (needs the "
                                                "wandb package; WANDB_MODE=offline works).")
    wandb_exp_name: Optional[str] = help_field(None, "(Megatron) The W&B run's name; required with wandb_project.")
    wandb_save_dir: Optional[str] = help_field(None, "(Megatron) Where W&B writes (default output_dir/wandb); it keeps "
                                                 "the run id, so a resumed run continues the same W&B run.")
    wandb_entity: Optional[str] = help_field(None, "(Megatron) The W&B entity (team or user).")
    decoupled_lr: Optional[float] = help_field(None, "(Megatron) Peak learning rate of the input embedding and output "
                                                 "layer weights (same schedule shape); unset: lr.")
    decoupled_min_lr: Optional[float] = help_field(None, "(Megatron) Minimum learning rate of those weights; unset: "
                                                     "min_lr. Needs decoupled_lr.")
    apply_wd_to_qk_layernorm: bool = help_field(False, "(Megatron) Apply weight decay to the QK-norm weights "
                                                   "(q_norm / k_norm) although they are 1-D.")
    start_weight_decay: Optional[float] = help_field(None, "(Megatron) Weight decay at the start of training "
                                                       "(linear/cosine weight_decay_incr_style only).")
    end_weight_decay: Optional[float] = help_field(None, "(Megatron) Weight decay at the end of training "
                                                     "(linear/cosine weight_decay_incr_style only).")
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = help_field(
        "constant", "(Megatron) How weight decay goes from start_weight_decay to end_weight_decay over training; "
                    "constant uses weight_decay throughout.")
    lr_scheduler_on_resume: Literal["check", "checkpoint", "override"] = help_field(
        "check", "(Megatron) On resume, when the schedule (lr, min_lr, warmup, decay, weight decay) differs from "
                 "the checkpoint's: check refuses to start (Megatron's default), checkpoint continues with the "
                 "checkpoint's schedule (--use-checkpoint-opt_param-scheduler), override uses this run's "
                 "(--override-opt_param-scheduler).")
    exit_duration_in_mins: Optional[float] = help_field(None, "(Megatron) Stop (after saving) once training has run "
                                                          "this many minutes; every rank stops at the same "
                                                          "iteration.")
    check_for_nan_in_loss_and_grad: bool = help_field(True, "(Megatron) Stop the run with an error at the first "
                                                        "iteration whose loss or gradient norm is NaN/Inf (nothing "
                                                        "saved or exported after it); false skips such iterations "
                                                        "(--no-check-for-nan-in-loss-and-grad).")
    exit_signal_handler: bool = help_field(False, "(Megatron) On exit_signal (SIGTERM by default: a scheduler's "
                                              "preemption), save a checkpoint at the next iteration boundary and "
                                              "exit (--exit-signal-handler).")
    exit_signal: str = help_field("SIGTERM", "(Megatron) The signal exit_signal_handler catches (a name such as SIGTERM "
                                         "or SIGUSR1, or its number).")
