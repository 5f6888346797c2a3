"""The flags with an FSDP2 meaning outside the model architecture: one handler each, with the field it fills.

Every handler runs on every translation, with the flag's value or Megatron's default, so that Megatron's
defaults reach the native config (its lr schedule is linear, its Adam beta2 0.999, its seed 1234, ...). A
handler may decline its flag for a value it cannot honour, or find it without effect; otherwise the flag is
reported as mapped to the target named here. `HANDLERS`: dest → (target, handler); `DERIVED_STEPS` fill
fields that several flags determine together (the pretraining stage). Derived values (gradient accumulation from
--global-batch-size, the padded vocabulary) are the engine's, computed once in validation / the model build.
"""
from __future__ import annotations

import os

from megatron_compat.translate.handler_table import HANDLERS, _direct, handles


# --- one-to-one fields (Megatron's default applies when the flag is absent) --------------------------------------
for _dest, _target in {
    "tensor_model_parallel_size": "parallel.tp_size", "context_parallel_size": "parallel.cp_size",
    "expert_model_parallel_size": "parallel.ep_size",
    "seq_length": "data.cutoff_len", "data_cache_path": "data.data_cache_path", "mock_data": "data.mock_data",
    "no_shared_storage": "data.no_shared_storage",
    "reset_position_ids": "data.reset_position_ids", "eod_mask_loss": "data.eod_mask_loss",
    "mmap_bin_files": "data.mmap_bin_files", "workers": "data.preprocessing_num_workers",
    "mid_level_dataset_surplus": "data.mid_level_dataset_surplus",
    "vocab_file": "model.vocab_file", "merge_file": "model.merge_file", "trust_remote_code": "model.trust_remote_code",
    "init_model_with_meta_device": "model.init_model_with_meta_device",
    "lr": "training.lr", "min_lr": "training.min_lr", "weight_decay": "training.weight_decay",
    "adam_beta1": "training.adam_beta1", "adam_beta2": "training.adam_beta2", "adam_eps": "training.adam_epsilon",
    "clip_grad": "training.max_grad_norm", "seed": "training.seed", "log_interval": "training.logging_steps",
    "train_iters": "training.max_steps", "train_samples": "training.train_samples",
    "exit_interval": "training.exit_interval", "eval_interval": "training.eval_interval",
    "eval_iters": "training.eval_iters", "lr_warmup_iters": "training.lr_warmup_iters",
    "lr_warmup_samples": "training.lr_warmup_samples", "lr_warmup_init": "training.lr_warmup_init",
    "lr_decay_iters": "training.lr_decay_iters", "lr_decay_samples": "training.lr_decay_samples",
    "lr_wsd_decay_style": "training.lr_wsd_decay_style", "lr_wsd_decay_iters": "training.lr_wsd_decay_iters",
    "lr_wsd_decay_samples": "training.lr_wsd_decay_samples", "lr_decay_style": "training.lr_scheduler_type",
    "save_interval": "training.save_steps", "no_load_optim": "training.no_load_optim",
    "no_load_rng": "training.no_load_rng", "no_save_optim": "training.no_save_optim",
    "no_save_rng": "training.no_save_rng", "finetune": "training.finetune", "async_save": "training.save_async",
    "tensorboard_dir": "training.tensorboard_dir", "calculate_per_token_loss": "training.calculate_per_token_loss",
    "global_batch_size": "training.global_batch_size", "no_shuffle": "training.disable_shuffling",
    "decoupled_lr": "training.decoupled_lr", "apply_wd_to_qk_layernorm": "training.apply_wd_to_qk_layernorm",
    "exit_duration_in_mins": "training.exit_duration_in_mins", "start_weight_decay": "training.start_weight_decay",
    "end_weight_decay": "training.end_weight_decay",
    "use_flash_attn": "optimization.use_flash_attn", "use_fused_rmsnorm": "optimization.use_fused_rmsnorm",
    "use_fused_rotary_pos_emb": "optimization.use_fused_rotary_pos_emb",
    "moe_grouped_gemm": "optimization.moe_grouped_gemm", "use_triton_gdn": "optimization.use_triton_gdn",
    "fix_router": "optimization.fix_router", "loss_chunk_size": "optimization.chunk_loss_size",
    "pack": "data.packing", "append_eod": "data.append_eod", "profile": "profiling.profile",
    "profile_level": "profiling.profile_level", "profile_export_type": "profiling.profile_export_type",
    "profile_data_simplification": "profiling.profile_data_simplification",
    "profile_with_cpu": "profiling.profile_with_cpu", "profile_with_memory": "profiling.profile_with_memory",
    "profile_with_stack": "profiling.profile_with_stack", "profile_record_shapes": "profiling.profile_record_shapes",
    "profile_save_path": "profiling.profile_save_path", "log_throughput": "training.log_throughput",
    "pytorch_profiler_collect_shapes": "profiling.profile_record_shapes",
    "record_shapes": "profiling.profile_record_shapes",
    "pytorch_profiler_collect_callstack": "profiling.profile_with_stack",
    "tensorboard_log_interval": "training.tensorboard_log_interval", "log_params_norm": "training.log_params_norm",
    "log_memory_to_tensorboard": "training.log_memory_to_tensorboard",
    "log_validation_ppl_to_tensorboard": "training.log_validation_ppl_to_tensorboard",
    "log_timers_to_tensorboard": "training.log_timers_to_tensorboard", "log_progress": "training.log_progress",
    "deterministic_mode": "training.deterministic",  # Megatron's default off; MindSpeed YAMLs' default on
}.items():
    _direct(_dest, _target)

_direct("micro_batch_size", "training.per_device_train_batch_size")
for _dest in ("wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity"):  # Megatron's default '' = unset
    _direct(_dest, f"training.{_dest}", lambda v: v or None)
_direct("batch_size", "training.per_device_train_batch_size")
_direct("tokenizer_not_use_fast", "model.use_fast_tokenizer", lambda v: not v)
_direct("mamba_chunk_size", "optimization.gdn_chunk_size")
_direct("lr_warmup_fraction", "training.warmup_ratio", lambda v: 0.0 if v is None else v, when_none=True)
@handles("create_attention_mask_in_dataloader", "data.create_attention_mask_in_dataloader")
def _mask_in_loader(ctx, value):
    if "create_attention_mask_in_dataloader" in ctx.active:  # a memory/speed choice: only when the script says
        ctx.set("data.create_attention_mask_in_dataloader", value)
_direct("torch_fsdp2_reshard_after_forward", "parallel.reshard_after_forward")
_direct("check_for_nan_in_loss_and_grad", "training.check_for_nan_in_loss_and_grad")  # on by default, as Megatron
_direct("exit_signal_handler", "training.exit_signal_handler")
def _signal_name(value) -> str:
    """Megatron's default is signal.SIGTERM (its table stores 15): the name, as a user writes it (was '15')."""
    from fsdp2_backend.config.signal_names import resolve_signal

    resolved = resolve_signal(str(int(value)) if isinstance(value, int) else str(value))
    return resolved.name if resolved is not None else str(value)


_direct("exit_signal", "training.exit_signal", _signal_name)
_direct("tokenizer_hf_no_use_fast", "model.use_fast_tokenizer", lambda v: not v)


@handles("profile_ranks", "profiling.profile_ranks (none given: every rank)")
def _profile_ranks(ctx, value):
    if ctx.get("profile") or value:
        ctx.set("profiling.profile_ranks", list(value) if value else [-1])  # Megatron: [] profiles every rank


@handles("sequence_parallel", "parallel.sequence_parallel (only with tensor parallel, as in Megatron)")
def _sequence_parallel(ctx, value):
    ctx.set("parallel.sequence_parallel", bool(value) and ctx.get("tensor_model_parallel_size") > 1)
    if value and ctx.get("tensor_model_parallel_size") == 1:
        ctx.record("sequence_parallel", "no_effect", "Megatron turns sequence parallel off without tensor parallel")


@handles("profile_step_start", "profiling.profile_step_start")
def _profile_start(ctx, value):
    if ctx.get("profile"):  # Megatron's window defaults (10, 12) apply only when profiling
        ctx.set("profiling.profile_step_start", value)


@handles("profile_step_end", "profiling.profile_step_end")
def _profile_end(ctx, value):
    if ctx.get("profile"):
        ctx.set("profiling.profile_step_end", value)


@handles("fp16", "parallel.param_dtype")
def _fp16(ctx, value):
    if not ctx.get("bf16"):
        ctx.set("parallel.param_dtype", "fp16" if value else "fp32")  # Megatron without either trains in fp32


@handles("bf16", "parallel.param_dtype")
def _bf16(ctx, value):
    if value:
        if ctx.get("fp16"):
            ctx.decline("bf16", "--bf16 and --fp16 are exclusive — keep one")
        ctx.set("parallel.param_dtype", "bf16")


for _dest in ("grad_reduce_in_bf16", "o2_gradient"):  # Megatron's flag and MindSpeed's O2 spelling
    @handles(_dest, "parallel.reduce_dtype bf16")
    def _grad_reduce(ctx, value):
        if value:
            ctx.set("parallel.reduce_dtype", "bf16")


@handles("distributed_backend", "parallel.distributed_backend (nccl/hccl: by device)")
def _backend(ctx, value):
    # Megatron's 'nccl' means "the accelerator's backend" (MindSpeed patches it to hccl); gloo is explicit.
    ctx.set("parallel.distributed_backend", "gloo" if value == "gloo" else None)


@handles("pipeline_model_parallel_size", "parallel: pipeline stages folded into FSDP data parallel")
def _pipeline(ctx, value):
    if value and value > 1:
        ctx.warn(f"--pipeline-model-parallel-size {value}: pipeline stages are folded into FSDP; the "
                 f"{value}× ranks become data-parallel (sharded) ranks on the same devices")


for _vp in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
    @handles(_vp, "parallel: virtual pipeline folded into FSDP")
    def _virtual(ctx, value, _dest=_vp):
        if value is not None:
            ctx.warn(f"{ctx.flag_names[_dest]} {value}: the virtual pipeline is folded into FSDP")


_CP_COMM = {"p2p": "ring", "a2a": "ulysses", "allgather": "ring", "a2a+p2p": "ring"}
_CP_ALGO = {"ulysses_cp_algo": "ulysses", "megatron_cp_algo": "ring"}


@handles("cp_comm_type", "parallel.cp_type (p2p → ring, a2a → ulysses)")
def _cp_comm(ctx, value):
    kind = value[0] if isinstance(value, list) and value else "p2p"
    if ctx.get("context_parallel_size", 1) > 1 and ctx.get("context_parallel_algo") is None:
        ctx.set("parallel.cp_type", _CP_COMM.get(kind, "ring"))
        if kind not in ("p2p", "a2a"):
            ctx.warn(f"--cp-comm-type {kind}: computed as ring attention (the same attention, exchanged by p2p)")


@handles("context_parallel_algo", "parallel.cp_type (ulysses_cp_algo → ulysses, megatron_cp_algo → ring)")
def _cp_algo(ctx, value):
    if value is None or (ctx.get("context_parallel_size", 1) <= 1 and "context_parallel_algo" not in ctx.active):
        return
    ctx.set("parallel.cp_type", _CP_ALGO.get(value, "ring"))
    if value not in _CP_ALGO and ctx.get("context_parallel_size", 1) > 1:
        ctx.warn(f"--context-parallel-algo {value}: computed as ring attention (the same attention result)")


# --- model loading, saving, tokenizer ---------------------------------------------------------------------------

def is_hf_model_dir(path) -> bool:
    """A Hugging Face model directory (config.json inside) rather than a checkpoint (save) directory."""
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


def loads_checkpoint(ctx) -> bool:
    """`--load X` names a save directory to resume or fine-tune from (possibly empty yet), not an HF model:
    X exists and holds no config.json, or X does not exist yet and equals --save (Megatron's resume pattern).
    A missing X elsewhere is taken as the HF model directory the script means (its loading says if it is not)."""
    load = ctx.get("load")
    if load in (None, "None") or is_hf_model_dir(load):
        return False
    return os.path.exists(load) or load == ctx.get("save")


@handles("load", "model.model_name_or_path (an HF directory) or training.resume_from_checkpoint (a checkpoint "
                 "directory: resumed, or the run starts from scratch while it holds none)")
def _load(ctx, value):
    if value is None or value == "None":  # MindSpeed scripts write `--load None` for "no checkpoint"
        ctx.set("model.train_from_scratch", True)
    elif loads_checkpoint(ctx):
        ctx.set("training.resume_from_checkpoint", value)
    else:
        ctx.set("model.model_name_or_path", value)


@handles("use_checkpoint_args", "model.architecture from the checkpoint in --load (architecture flags dropped)")
def _use_checkpoint_args(ctx, value):
    if value and not loads_checkpoint(ctx):
        ctx.record("use_checkpoint_args", "no_effect", "read only with --load naming a checkpoint directory")


@handles("save", "training.output_dir (absent: training.save_checkpoints false)")
def _save(ctx, value):
    if value is None:
        ctx.set("training.save_checkpoints", False)  # Megatron without --save writes no checkpoints
        return
    ctx.set("training.output_dir", value)
    ctx.set("training.save_total_limit", None)  # Megatron keeps every checkpoint
    if ctx.get("save_interval") is None and ctx.get("train_iters"):
        ctx.set("training.save_steps", ctx.get("train_iters"))  # Megatron saves once, at the end


_HF_TOKENIZERS = ("HuggingFaceTokenizer", "PretrainedFromHF")


@handles("tokenizer_type", "model.tokenizer_type (HuggingFaceTokenizer/PretrainedFromHF: HF AutoTokenizer)")
def _tokenizer_type(ctx, value):
    if value not in (None,) + _HF_TOKENIZERS:
        ctx.set("model.tokenizer_type", value)
    if value in ("NullTokenizer", "TikTokenizer") and ctx.get("vocab_size") is not None:
        ctx.set("model.vocab_size", ctx.get("vocab_size"))


@handles("tokenizer_model", "model.tokenizer_model (HF tokenizers: model.tokenizer_name_or_path)")
def _tokenizer_model(ctx, value):
    if value is None:
        return
    hf = ctx.get("tokenizer_type") in _HF_TOKENIZERS
    ctx.set("model.tokenizer_name_or_path" if hf else "model.tokenizer_model", value)


@handles("tokenizer_name_or_path", "model.tokenizer_name_or_path")
def _tokenizer_path(ctx, value):
    if value is not None:
        ctx.set("model.tokenizer_name_or_path", value)


_direct("mtp_num_layers", "model.mtp_num_layers")
_direct("mtp_loss_scaling_factor", "model.mtp_loss_scaling_factor")


@handles("make_vocab_size_divisible_by", "model.make_vocab_size_divisible_by (the engine pads to it × tp, as "
                                         "Megatron does)")
def _divisible(ctx, value):
    ctx.set("model.make_vocab_size_divisible_by", value)


# --- data -------------------------------------------------------------------------------------------------------

@handles("data_path", "data.dataset (a list: a prefix, or Megatron's blend W1 P1 W2 P2)")
def _data_path(ctx, value):
    if value:
        ctx.set("data.dataset", list(value))


for _split in ("train_data_path", "valid_data_path", "test_data_path"):
    _direct(_split, f"data.{_split}", list)


@handles("split", "data.split")
def _split_flag(ctx, value):
    if value is None and ctx.get("data_path"):
        value = "969, 30, 1"  # Megatron's default split for a single --data-path
    if value is not None:
        ctx.set("data.split", ",".join(part.strip() for part in value.split(",")))


@handles("reset_attention_mask", "data.reset_attention_mask (+ data.append_eod)")
def _reset_attention_mask(ctx, value):
    if value:
        ctx.set("data.reset_attention_mask", True)
        ctx.set("data.append_eod", True)  # Megatron finds the documents by their EOD tokens


@handles("dataloader_type", "data.dataloader_type (single or cyclic)")
def _dataloader_type(ctx, value):
    if value == "external":
        ctx.decline("dataloader_type", "'external' needs user code — use single or cyclic")
    elif value is not None:
        ctx.set("data.dataloader_type", value)


@handles("num_workers", "training.dataloader_num_workers")
def _num_workers(ctx, value):
    if "num_workers" in ctx.active:  # a speed setting: only when the script chose it
        ctx.set("training.dataloader_num_workers", value)


def _pretraining(ctx):
    ctx.set("training.stage", "pt")
    ctx.set("data.data_manager_type", "mg")
    ctx.set("training.num_train_epochs", 0.0)  # Megatron trains by --train-iters or --train-samples, never epochs
    ctx.set("training.dataloader_drop_last", True)  # Megatron's samplers drop an incomplete last group


# Steps that derive fields from several flags, run after every handler.
DERIVED_STEPS = (_pretraining,)


# Handlers that live in modules of their own register themselves on import.
from megatron_compat.translate import recompute  # noqa: E402,F401
from megatron_compat.translate import tokenizer_data  # noqa: E402,F401
from megatron_compat.translate import mup  # noqa: E402,F401
from megatron_compat.translate import batch_optim  # noqa: E402,F401
from megatron_compat.translate import memory_layout  # noqa: E402,F401
from megatron_compat.translate import fp8  # noqa: E402,F401
from megatron_compat.translate import mla_scale  # noqa: E402,F401

