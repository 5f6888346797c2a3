"""Every rule a configuration must satisfy, checked once before any process group, device or file is touched.

`validate(config, world_size)` reports every problem at once (UsageError with one message each, in the form
`<group.field>: <what is wrong> — <what to do>`) and returns the config with its derived values filled in
(gradient accumulation from the global batch, packing implied by neat_packing). Features that do not exist
yet are declined here when set to a non-default value, so nothing is accepted and silently ignored.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import List

from fsdp2_backend.config.schema import Config, parallel_layout
from usage_errors import UsageError

# Data fields that only the SFT data path (data_manager_type lf) reads; with pretraining they would be ignored.
SFT_ONLY_DATA_FIELDS = ("template", "eval_dataset", "train_on_prompt", "mask_history", "streaming", "mix_strategy",
                        "interleave_probs", "eval_num_beams", "val_size", "eval_on_each_dataset", "packing",
                        "neat_packing", "tool_format", "default_system", "enable_thinking", "dataset_dir",
                        "buffer_size", "ignore_pad_token_for_loss")

# Model fields that only a quantisation recipe reads.
QUANT_ONLY_MODEL_FIELDS = ("quant_apply_modules", "quant_ignored_modules", "quant_converters",
                           "enable_fsdp_low_precision_all_gather", "fsdp_low_precision_all_gather_mode")

# Fields whose features are not built yet: (group, field, why).
NOT_YET = (
    ("model", "quant_recipe_name", "quantised training (mxfp8) is not implemented yet"),
    ("model", "new_special_tokens_config", "semantic initialisation of special tokens comes with the SFT work"),
    ("model", "ms_hub_token", "downloads from ModelScope are not supported; download the model and pass its "
                              "local directory"),
    ("model", "om_hub_token", "downloads from Modelers are not supported; download the model and pass its "
                              "local directory"),
)


def registered_model_ids() -> List[str]:
    """Model ids with an implementation in this project (the registry, read without importing torch)."""
    from fsdp2_backend.models import registry

    return sorted(registry.registered_model_ids())


def _check_sizes(config: Config, world_size: int, errors: List[str]) -> None:
    p, t = config.parallel, config.training
    for name in ("tp_size", "cp_size", "ep_size", "ep_fsdp_size", "fsdp_size"):
        if getattr(p, name) < 1:
            errors.append(f"parallel.{name}: must be at least 1, got {getattr(p, name)}")
    if errors:
        return
    if world_size % (p.tp_size * p.cp_size):
        errors.append(f"parallel.tp_size x parallel.cp_size: the world size {world_size} is not divisible by "
                      f"tp {p.tp_size} x cp {p.cp_size} — choose sizes whose product divides {world_size}")
        return
    layout = parallel_layout(p, world_size)
    if p.fsdp_size > 1 and layout.dp % p.fsdp_size:
        errors.append(f"parallel.fsdp_size: {p.fsdp_size} does not divide the data-parallel size {layout.dp} "
                      f"(world {world_size} / tp {p.tp_size} / cp {p.cp_size}) — use a divisor, or 1 for all")
    if world_size % (p.ep_size * p.ep_fsdp_size):
        errors.append(f"parallel.ep_size x parallel.ep_fsdp_size: {p.ep_size} x {p.ep_fsdp_size} does not divide "
                      f"the world size {world_size} — choose sizes whose product divides it")
    mbs = t.per_device_train_batch_size
    if mbs < 1:
        errors.append(f"training.per_device_train_batch_size: must be at least 1, got {mbs}")
    elif t.global_batch_size is not None:
        if t.global_batch_size % (mbs * layout.dp):
            errors.append(f"training.global_batch_size: {t.global_batch_size} is not divisible by micro batch "
                          f"{mbs} x data-parallel size {layout.dp} — change --global-batch-size or "
                          f"--micro-batch-size")
    if t.gradient_accumulation_steps < 1:
        errors.append("training.gradient_accumulation_steps: must be at least 1")


def _check_seed_rules(config: Config, errors: List[str]) -> None:
    m, d, p, t, prof, o = (config.model, config.data, config.parallel, config.training, config.profiling,
                          config.optimization)
    if not m.model_name_or_path and not m.architecture:
        errors.append("model.model_name_or_path: required — give an HF model directory (Megatron --load), or "
                      "model.architecture to build a model from scratch")
    if not t.output_dir and t.save_checkpoints:
        errors.append("training.output_dir: required — give a directory for checkpoints (Megatron --save), or "
                      "set training.save_checkpoints: false")
    if d.eval_dataset is not None and d.val_size:
        errors.append("data.eval_dataset / data.val_size: exclusive — set only one of them")
    if d.train_on_prompt and d.mask_history:
        errors.append("data.train_on_prompt / data.mask_history: exclusive — set only one of them")
    if d.streaming and d.max_samples is not None:
        errors.append("data.streaming / data.max_samples: exclusive — drop max_samples when streaming")
    if d.streaming and float(d.val_size) != int(d.val_size):
        errors.append(f"data.val_size: must be an integer under streaming, got {d.val_size}")
    if d.val_size < 0:
        errors.append(f"data.val_size: must be >= 0, got {d.val_size}")
    if o.use_triton_gdn and o.use_flash_gdn:
        errors.append("optimization.use_triton_gdn / optimization.use_flash_gdn: at most one may be on")
    if d.reset_attention_mask and not d.append_eod:
        errors.append("data.reset_attention_mask: needs data.append_eod (documents are found by their EOD) — "
                      "set data.append_eod: true")
    if not p.fsdp_modules:
        errors.append("parallel.fsdp_modules: must not be empty — e.g. ['model.layers.{}', 'model.embed_tokens', "
                      "'lm_head']")
    if d.interleave_probs is not None and not d.mix_strategy.startswith("interleave"):
        errors.append("data.interleave_probs: only used with mix_strategy interleave_under or interleave_over")
    if prof.profile_step_start < 0:
        errors.append(f"profiling.profile_step_start: must be >= 0, got {prof.profile_step_start}")
    if prof.profile_step_end != -1 and prof.profile_step_end <= prof.profile_step_start:
        errors.append(f"profiling.profile_step_end: must be -1 or greater than profile_step_start "
                      f"({prof.profile_step_start}), got {prof.profile_step_end}")
    if m.model_id is not None:
        known = registered_model_ids()
        if m.model_id not in known:
            errors.append(f"model.model_id: '{m.model_id}' has no implementation yet — registered: "
                          f"{', '.join(known)}; or unset it to run the native transformers model")
    if t.max_steps <= 0 and t.train_samples is None and t.num_train_epochs <= 0:
        errors.append("training.max_steps: give max_steps (Megatron --train-iters), train_samples or "
                      "num_train_epochs > 0")
    if t.logging_steps < 1:
        errors.append(f"training.logging_steps: must be at least 1, got {t.logging_steps}")
    if t.save_steps < 1:
        errors.append(f"training.save_steps: must be at least 1, got {t.save_steps}")


def _check_optimizer_schedule(config: Config, errors: List[str]) -> None:
    """Megatron's rules for the decoupled lr, the weight-decay increment and the time-based exit."""
    t = config.training
    if t.decoupled_min_lr is not None and t.decoupled_lr is None:
        errors.append("training.decoupled_min_lr: only used with training.decoupled_lr — set decoupled_lr too, "
                      "or unset decoupled_min_lr")
    for name in ("decoupled_lr", "decoupled_min_lr", "start_weight_decay", "end_weight_decay"):
        value = getattr(t, name)
        if value is not None and value < 0:
            errors.append(f"training.{name}: must be >= 0, got {value}")
    given = [n for n in ("start_weight_decay", "end_weight_decay") if getattr(t, n) is not None]
    if t.weight_decay_incr_style == "constant" and given:
        errors.append(f"training.{given[0]}: only used with weight_decay_incr_style linear or cosine (constant "
                      "uses weight_decay) — set the style, or unset start/end_weight_decay")
    elif t.weight_decay_incr_style != "constant":
        if len(given) < 2:
            errors.append(f"training.weight_decay_incr_style: {t.weight_decay_incr_style} needs both "
                          "start_weight_decay and end_weight_decay — set them")
        elif t.start_weight_decay > t.end_weight_decay:
            errors.append(f"training.start_weight_decay: {t.start_weight_decay} exceeds end_weight_decay "
                          f"{t.end_weight_decay} — weight decay can only increase (Megatron's rule)")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        errors.append(f"training.exit_duration_in_mins: must be positive, got {t.exit_duration_in_mins} — give "
                      "minutes, or unset it")


def _check_not_yet(config: Config, errors: List[str]) -> None:
    defaults = Config()
    for group, name, why in NOT_YET:
        if getattr(getattr(config, group), name) != getattr(getattr(defaults, group), name):
            errors.append(f"{group}.{name}: {why} — unset it")
    if config.model.init_special_tokens != "noise_init":
        errors.append("model.init_special_tokens: desc_init variants come with the SFT work — use noise_init")
    if config.training.stage == "sft":
        errors.append("training.stage: 'sft' is not supported yet — set training.stage: pt (pretraining)")
    if config.data.data_manager_type == "lf":
        errors.append("data.data_manager_type: 'lf' (the fine-tuning data path) is not supported yet — set "
                      "data.data_manager_type: mg (Megatron pretraining data)")
    for name in QUANT_ONLY_MODEL_FIELDS:
        if getattr(config.model, name) != getattr(defaults.model, name) and config.model.quant_recipe_name is None:
            errors.append(f"model.{name}: only used with model.quant_recipe_name — unset it")
    for name in SFT_ONLY_DATA_FIELDS:
        if getattr(config.data, name) != getattr(defaults.data, name):
            errors.append(f"data.{name}: only used by the SFT data path, which is not supported yet — unset it")
    if config.parallel.ep_dispatcher == "mc2":
        errors.append("parallel.ep_dispatcher: mc2 needs Ascend NPUs (torch_npu MC2 kernels) — use eager or fused")


def _hf_config_json(path: str | None, errors: List[str]) -> dict | None:
    """The config.json of an HF model directory, or None when `path` holds none."""
    config_file = os.path.join(path, "config.json") if path else None
    if not config_file or not os.path.isfile(config_file):
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        errors.append(f"{config_file}: cannot read the model config ({exc}) — check the model directory")
        return None


def _check_architecture(config: Config, errors: List[str]) -> None:
    """Architecture flags given together with an HF directory must agree with its config.json."""
    arch, path = config.model.architecture, config.model.model_name_or_path
    hf = _hf_config_json(path, errors) if arch else None
    if not hf:
        return
    for key, value in arch.items():
        if key in hf and hf[key] != value and not (key == "vocab_size" and isinstance(value, int)
                                                   and hf[key] <= value):
            errors.append(f"model.architecture.{key}: the flags say {value!r} but {path}/config.json says "
                          f"{hf[key]!r} — fix the flag or the model directory")


def _model_type(config: Config) -> str | None:
    arch = config.model.architecture or {}
    return arch.get("model_type") or (_hf_config_json(config.model.model_name_or_path, []) or {}).get("model_type")


def validate(config: Config, world_size: int = 1) -> Config:
    """Checks every rule; returns the config with derived values filled in, or raises UsageError listing all."""
    errors: List[str] = []
    _check_seed_rules(config, errors)
    _check_optimizer_schedule(config, errors)
    _check_not_yet(config, errors)
    _check_sizes(config, world_size, errors)
    _check_architecture(config, errors)
    if errors:
        raise UsageError(errors)
    return normalise(config, world_size)


def normalise(config: Config, world_size: int) -> Config:
    """Fills derived values: packing implied by neat_packing, gradient accumulation from the global batch, and
    the stacked-expert Qwen3-MoE (model_id qwen3_moe) when expert parallel or MoE kernels ask for it."""
    data, training, model = config.data, config.training, config.model
    wants_moe_model = (config.parallel.ep_size > 1 or config.optimization.moe_grouped_gemm
                       or config.optimization.fix_router)
    if model.model_id is None and wants_moe_model and _model_type(config) == "qwen3_moe":
        model = replace(model, model_id="qwen3_moe")
    if data.neat_packing and not data.packing:
        data = replace(data, packing=True)
    if training.global_batch_size is not None:
        dp = parallel_layout(config.parallel, world_size).dp
        training = replace(training, gradient_accumulation_steps=training.global_batch_size
                           // (training.per_device_train_batch_size * dp))
    return replace(config, model=model, data=data, training=training)
