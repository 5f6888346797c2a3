"""Every rule a configuration must satisfy, checked once before any process group, device or model exists.

`validate(config, world_size)` reports every problem at once (UsageError with one message each, in the form
`<group.field>: <what is wrong> — <what to do>`) and returns the config with its derived values filled in
(gradient accumulation from the global batch, packing implied by neat_packing, the dataset as a list).
`validate_with_notices` also returns the notices to print once: fields with no effect in the chosen mode.
The rules that need the model (heads, experts, layer types, vocabulary for TP/CP/EP) read its facts without
torch (`model_facts`) and live in `rules.parallel`. Features that do not exist yet are declined here when set,
so nothing is accepted and silently ignored. Runtime code may assert; it does not validate.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from typing import List, Optional, Set, Tuple

from fsdp2_backend.config.layout import parallel_layout
from fsdp2_backend.config.model_facts import ModelFacts, model_facts
from fsdp2_backend.config.mindspeed_release_rules import release_readings
from fsdp2_backend.config.mup_rules import mup_errors
from fsdp2_backend.config.rules.data import check_sft, fim_errors, normalise_sft, sft_notices
from fsdp2_backend.config.rules.mindspeed_master_fields import (head_field_errors, head_field_notices,
                                                                normalise_head_fields)
from fsdp2_backend.config.rules.model import (check_quantization, check_router_model, group_score_notices,
                                              megatron_router_set, mla_scale_errors, quant_notices, router_errors)
from fsdp2_backend.config.rules.optimization import compile_errors, compile_notices
from fsdp2_backend.config.rules.parallel import check_model_layout
from fsdp2_backend.config.rules.run_inputs import canonical_config, canonical_key, check_run_inputs
from fsdp2_backend.config.rules.training import batch_schedule_errors, optimizer_errors
from fsdp2_backend.config.schema import Config, dataset_entries
from fsdp2_backend.models import registry
from fsdp2_backend.models.registry import spec_for_model_type, spec_of
from fsdp2_backend.usage_errors import UsageError

# Data fields that only the SFT data path (data_manager_type lf) reads: with pretraining they have no effect, and
# MindSpeed's pretraining YAMLs set some (template), so they are accepted and reported once.
SFT_ONLY_DATA_FIELDS = ("template", "eval_dataset", "train_on_prompt", "mask_history", "streaming", "mix_strategy",
                        "interleave_probs", "eval_num_beams", "val_size", "eval_on_each_dataset", "packing",
                        "neat_packing", "tool_format", "default_system", "enable_thinking", "dataset_dir",
                        "buffer_size", "ignore_pad_token_for_loss")

# Fields whose features are not built yet: (group, field, why).
NOT_YET = (
    ("model", "ms_hub_token", "downloads from ModelScope are not supported; download the model and pass its "
                              "local directory"),
    ("model", "om_hub_token", "downloads from Modelers are not supported; download the model and pass its "
                              "local directory"),
)


def registered_model_ids() -> List[str]:
    """Model ids with an implementation in this project (the registry, read without importing torch)."""
    return sorted(registry.registered_model_ids())


def _check_sizes(config: Config, world_size: int, errors: List[str]) -> None:
    p, t = config.parallel, config.training
    found_before = len(errors)  # other groups' problems do not stop these checks (all problems at once)
    for name in ("tp_size", "cp_size", "ep_size", "ep_fsdp_size", "fsdp_size"):
        if getattr(p, name) < 1:
            errors.append(f"parallel.{name}: must be at least 1, got {getattr(p, name)}")
    if p.activation_offload_layers < -1:
        errors.append(f"parallel.activation_offload_layers: {p.activation_offload_layers} — give the number of "
                      f"decoder layers whose activations go to the host, 0 for none or -1 for all")
    elif p.activation_offload_layers and p.recompute:  # as Megatron: offloading and recomputing do not mix
        errors.append("parallel.activation_offload_layers: given with parallel.recompute (Megatron refuses CPU "
                      "offloading with activation recomputation too) — choose one")
    if len(errors) > found_before:
        return
    if world_size % (p.tp_size * p.cp_size):
        errors.append(f"parallel.tp_size x parallel.cp_size: the world size {world_size} is not divisible by "
                      f"tp {p.tp_size} x cp {p.cp_size} — choose sizes whose product divides {world_size}")
        return
    layout = parallel_layout(p, world_size)
    if layout.dp_shard == 0:
        errors.append(f"parallel.fsdp_size: {p.fsdp_size} does not divide the data-parallel size {layout.dp} "
                      f"(world {world_size} / tp {p.tp_size} / cp {p.cp_size}; counted with cp inside: a multiple "
                      f"of cp {p.cp_size} whose quotient divides {layout.dp}) — use such a size, or 1 (or the "
                      f"world size) for all")
    if world_size % (p.ep_size * p.ep_fsdp_size):
        errors.append(f"parallel.ep_size x parallel.ep_fsdp_size: {p.ep_size} x {p.ep_fsdp_size} does not divide "
                      f"the world size {world_size} — choose sizes whose product divides it")
    mbs = t.per_device_train_batch_size
    if mbs < 1:
        errors.append(f"training.per_device_train_batch_size: must be at least 1, got {mbs}")
    elif t.global_batch_size is not None and t.decrease_batch_size_if_needed:  # Megatron rounds it down
        if t.global_batch_size < mbs * layout.dp:
            errors.append(f"training.global_batch_size: {t.global_batch_size} is below one micro batch {mbs} per "
                          f"data-parallel rank ({layout.dp}), even rounded down — raise --global-batch-size")
    elif t.global_batch_size is not None:
        if t.global_batch_size % (mbs * layout.dp):
            errors.append(f"training.global_batch_size: {t.global_batch_size} is not divisible by micro batch "
                          f"{mbs} x data-parallel size {layout.dp} — change --global-batch-size or "
                          f"--micro-batch-size")
    if t.gradient_accumulation_steps < 1:
        errors.append("training.gradient_accumulation_steps: must be at least 1")
    errors.extend(batch_schedule_errors(config, world_size))


def _check_seed_rules(config: Config, errors: List[str]) -> None:
    m, d, p, t, prof, o = (config.model, config.data, config.parallel, config.training, config.profiling,
                          config.optimization)

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
    if o.gdn_chunk_size < 1:
        errors.append(f"optimization.gdn_chunk_size: must be >= 1 (Gated DeltaNet chunk length), got "
                      f"{o.gdn_chunk_size} — use 64")
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
    if prof.profile and prof.profile_export_type == "db" and importlib.util.find_spec("torch_npu") is None:
        errors.append("profiling.profile_export_type: db is torch_npu's format and this machine has no torch_npu "
                      "(Ascend) — use text (a Chrome trace)")
    errors.extend(router_errors(m))
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
    if t.save_steps < 0:
        errors.append(f"training.save_steps: must be >= 0 (0: no periodic saves), got {t.save_steps}")
    if t.max_steps > 0 and t.train_samples is not None:
        errors.append("training.max_steps / training.train_samples: give one training length (Megatron refuses "
                      "--train-iters with --train-samples) — drop one")
    parts = [part for part in re.split(r"[,/]", d.split) if part.strip()]
    if len(parts) > 3:
        errors.append(f"data.split: {d.split!r} has {len(parts)} parts — give at most three weights "
                      f"(train,valid,test), as Megatron's --split")
    else:
        try:
            [float(part) for part in parts]
        except ValueError:
            errors.append(f"data.split: {d.split!r} is not comma-separated numbers — e.g. 969,30,1")
    chunk = o.chunk_loss_size
    if chunk is not None and chunk <= 0:
        errors.append(f"optimization.chunk_loss_size: {chunk} is not a positive number of tokens — give a "
                      f"positive chunk size or leave it unset")
    if chunk and p.tp_size > 1:
        errors.append("optimization.chunk_loss_size: not available with tensor parallel (parallel.tp_size "
                      f"{p.tp_size}) yet — unset chunk_loss_size or use tp_size 1")
    mtp = config.model.mtp_num_layers
    if mtp is not None and mtp < 1:
        errors.append(f"model.mtp_num_layers: {mtp} is not a number of MTP depths — give at least 1, or unset it")
    elif mtp:  # models/mtp.py: plain modules under FSDP2 / TP / CP / EP (their experts get the expert plan, build._with_mtp)
        spec = spec_of(config.model.model_id)
        for name, why in ((chunk, "optimization.chunk_loss_size (the head computes the MTP loss from full logits)"),
                          (spec is not None and spec.mtp_layout is None,  # its spec names no MTP layout
                           f"model.model_id {config.model.model_id} (no MTP layer layout for it yet)"),
                          (spec is not None and spec.mtp_depths not in (None, mtp),  # e.g. one fc / norm pair
                           spec and spec.note("mtp", mtp=mtp)),
                          (config.model.init_model_with_meta_device,
                           "model.init_model_with_meta_device (MTP weights are initialised on a real device)")):
            if name:
                errors.append(f"model.mtp_num_layers: not available with {why} — unset one of them")
    if d.data_manager_type == "mg" and not d.mock_data:
        per_split = any([d.train_data_path, d.valid_data_path, d.test_data_path])
        if per_split and d.dataset:
            errors.append("data.dataset / data.train_data_path: give either one dataset split by data.split or "
                          "per-split paths, not both")
        elif not per_split and not d.dataset:
            errors.append("data.dataset: pretraining needs an indexed prefix, a blend [W1, P1, W2, P2] or a raw "
                          ".jsonl/.parquet file (or data.mock_data) — set data.dataset (Megatron --data-path)")
    if isinstance(d.dataset, dict) and not d.dataset.get("file_name") and d.data_manager_type == "mg":
        errors.append("data.dataset: an inline dataset needs file_name (MindSpeed's {file_name: FILE}) in "
                      "pretraining — give the raw .jsonl/.parquet file")


def _check_monitoring(config: Config, errors: List[str]) -> None:
    """W&B (Megatron's rule: a project needs an experiment name; the package must be installed) and intervals."""
    t = config.training
    if t.wandb_project:
        if not t.wandb_exp_name:
            errors.append("training.wandb_exp_name: required with wandb_project (Megatron --wandb-exp-name) — "
                          "name the W&B run")
        if importlib.util.find_spec("wandb") is None:
            errors.append("training.wandb_project: the wandb package is not installed — pip install wandb (or "
                          "megatron-fsdp2[wandb]), or drop wandb_project (--wandb-project)")
    if t.tensorboard_log_interval < 1:
        errors.append(f"training.tensorboard_log_interval: must be at least 1, got {t.tensorboard_log_interval}")


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
    if t.lr >= 0 and not 0.0 <= t.min_lr <= t.lr:  # a negative lr is reported once, by rules.run_inputs
        errors.append(f"training.min_lr: {t.min_lr} must lie in [0, lr={t.lr}] — lower min_lr (Megatron --min-lr)")
    if t.lr >= 0 and t.lr_warmup_init > t.lr:
        errors.append(f"training.lr_warmup_init: {t.lr_warmup_init} exceeds lr={t.lr} — lower lr_warmup_init")
    decay = t.lr_decay_iters or (t.max_steps if t.max_steps > 0 else None)
    if decay and t.lr_warmup_iters and t.lr_warmup_iters >= decay:
        errors.append(f"training.lr_warmup_iters: warmup ({t.lr_warmup_iters} iterations) must be shorter than the "
                      f"decay ({decay} iterations) — shorten the warmup")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        errors.append(f"training.exit_duration_in_mins: must be positive, got {t.exit_duration_in_mins} — give "
                      "minutes, or unset it")


def _check_not_yet(config: Config, errors: List[str]) -> None:
    defaults = Config()
    for group, name, why in NOT_YET:
        if getattr(getattr(config, group), name) != getattr(getattr(defaults, group), name):
            errors.append(f"{group}.{name}: {why} — unset it")
    check_sft(config, errors)  # stage sft / data_manager_type lf (rules.data)
    check_quantization(config, errors)  # quant_recipe_name and its fields (rules.model)
    errors.extend(fim_errors(config))  # data.fim_* (rules.data)
    if config.parallel.ep_dispatcher == "mc2" and config.parallel.ep_size > 1:  # ep 1: no dispatch (notices)
        errors.append("parallel.ep_dispatcher: mc2 needs Ascend NPUs (torch_npu MC2 kernels) — use eager or fused")


def _check_architecture(config: Config, facts: ModelFacts, errors: List[str]) -> None:
    """Architecture flags given together with an HF directory or a checkpoint must agree with its config.json
    (a larger vocabulary is a padding or a resize, not a disagreement)."""
    arch, hf = config.model.architecture or {}, canonical_config(facts.config_json)
    if not hf:
        return
    where = config.model.model_name_or_path if facts.source == "hf directory" else "the checkpoint's"
    for key, value in arch.items():
        name = canonical_key(key)  # GPT-style flags write n_layer; a Qwen3 config.json says num_hidden_layers
        if value is None or hf.get(name) is None or hf[name] == value:
            continue
        if name == "vocab_size" and isinstance(value, int) and hf[name] >= value:
            continue
        if facts.source == "checkpoint" and name in _MEGATRON_CHECKPOINT_WORDING:
            errors.append(f"model.architecture.{key}: {_MEGATRON_CHECKPOINT_WORDING[name]} value from checkpoint "
                          f"({hf[name]!r}) is not equal to the input {_MEGATRON_CHECKPOINT_WORDING[name]} value "
                          f"({value!r}) — drop the flag, fix it, or add --use-checkpoint-args")
            continue
        errors.append(f"model.architecture.{key}: the flags say {value!r} but {where} config.json says "
                      f"{hf[name]!r} — fix the flag, or drop the architecture flags (the model is defined there)")


# Megatron's words for a resumed run's shape mismatch ("hidden_size value from checkpoint (64) is not equal to
# the input hidden_size value (96)"), by HF key.
_MEGATRON_CHECKPOINT_WORDING = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
                                "num_attention_heads": "num_attention_heads", "intermediate_size": "ffn_hidden_size",
                                "num_key_value_heads": "num_query_groups", "head_dim": "kv_channels",
                                "max_position_embeddings": "max_position_embeddings"}


def _check_model_defined(config: Config, facts: ModelFacts, errors: List[str]) -> None:
    needed = spec_for_model_type(facts.model_type)  # a model type transformers builds no causal LM for
    if needed and needed.needs_model_id and config.model.model_id is None:
        errors.append(f"model.model_id: the model ({facts.model_type}, from the {facts.source}) has no causal LM in "
                      f"transformers — set model.model_id {needed.model_id}")
    if facts.source:
        return
    load = config.training.resume_from_checkpoint
    if load:
        errors.append(f"model.architecture: {load} holds no checkpoint yet and no model is given — add the "
                      f"architecture flags (--num-layers, --hidden-size, ...) or an HF model (--load HF_DIR / "
                      f"model.model_name_or_path) to start from")
    else:
        errors.append("model.model_name_or_path: required — give an HF model directory (Megatron --load), a "
                      "checkpoint to resume, or model.architecture to build a model from scratch")


def validate_with_notices(config: Config, world_size: int = 1,
                          native_fields: Optional[Set[Tuple[str, str]]] = None) -> Tuple[Config, List[str]]:
    """Checks every rule; returns (the config with derived values filled in, notices to print once), or raises
    UsageError listing every problem. `native_fields`: the (group, field) pairs a YAML or ``--group.field`` set (the
    MindSpeed version notes concern those only; None: every field)."""
    config, errors, release_notices = release_readings(config, native_fields)  # MindSpeed v26.1.0's spellings first
    _check_seed_rules(config, errors)
    _check_optimizer_schedule(config, errors)
    errors.extend(optimizer_errors(config))
    errors.extend(compile_errors(config))  # optimization.torch_compile with MXFP8 weights (rules.optimization)
    errors.extend(head_field_errors(config))  # MindSpeed c77308a1's fields (rules.mindspeed_master_fields)
    _check_monitoring(config, errors)
    _check_not_yet(config, errors)
    _check_sizes(config, world_size, errors)
    facts = model_facts(config, errors)
    _check_model_defined(config, facts, errors)
    _check_architecture(config, facts, errors)
    check_router_model(config, facts, errors)
    errors.extend(mup_errors(config, facts))  # model.use_mup / mup_* (mup_rules)
    errors.extend(mla_scale_errors(config, facts))  # model.mla_scale_* (rules.model)
    check_run_inputs(config, facts, world_size, errors)
    if not errors:
        check_model_layout(config, facts, world_size, errors)
    if errors:
        raise UsageError(errors)
    normalised = normalise(config, world_size, facts)
    return normalised, (release_notices + _notices(config) + group_score_notices(normalised, facts)
                        + compile_notices(normalised, facts))


def validate(config: Config, world_size: int = 1) -> Config:
    """`validate_with_notices` without the notices."""
    return validate_with_notices(config, world_size)[0]


def _notices(config: Config) -> List[str]:
    """Fields set that have no effect in the chosen mode (accepted, reported once)."""
    defaults = Config()
    notices = []
    if config.data.data_manager_type == "mg":
        notices += [f"data.{name}: no effect in pretraining (read by the SFT data path only)"
                    for name in SFT_ONLY_DATA_FIELDS if getattr(config.data, name) != getattr(defaults.data, name)]
        if isinstance(config.data.dataset, dict):  # MindSpeed's inline dataset: pretraining reads file_name only
            notices += [f"data.dataset.{key}: no effect in pretraining (only file_name is read)"
                        for key in config.data.dataset if key != "file_name"]
    if config.data.data_manager_type == "mg" and config.data.reset_position_ids and not config.data.reset_attention_mask:
        notices.append("data.reset_position_ids: the restarting positions also mark document boundaries here, so "
                       "attention (and recurrent state) stays within each document — Megatron attends across them "
                       "without --reset-attention-mask")
    notices += sft_notices(config)
    notices += head_field_notices(config)
    notices += quant_notices(config)
    t = config.training
    if not (t.tensorboard_dir or t.wandb_project):  # Megatron's scalar extras need somewhere to go
        notices += [f"training.{name}: no effect without training.tensorboard_dir or training.wandb_project"
                    for name in ("log_memory_to_tensorboard", "log_validation_ppl_to_tensorboard",
                                 "log_timers_to_tensorboard", "tensorboard_log_interval")
                    if getattr(t, name) != getattr(defaults.training, name)]
    if t.log_progress and not t.save_checkpoints:
        notices.append("training.log_progress: no effect without checkpoints (progress.txt lives in the save "
                       "directory, Megatron --save)")
    return notices


def normalise(config: Config, world_size: int, facts: ModelFacts = None) -> Config:
    """Fills derived values, once: packing implied by neat_packing, gradient accumulation from the global batch,
    the pretraining dataset as a list, and the stacked-expert MoE model (the id whose spec is `router_promoted` for
    the model type) when expert parallel, MoE kernels or Megatron's router options ask for it."""
    data, training, model = config.data, config.training, config.model
    wants_moe_model = (config.parallel.ep_size > 1 or config.optimization.moe_grouped_gemm
                       or config.optimization.fix_router or megatron_router_set(model))
    model_type = facts.model_type if facts is not None else (model.architecture or {}).get("model_type")
    recorded_router = facts is not None and bool((facts.config_json or {}).get("moe_router"))  # models/moe/router.py
    promoted = spec_for_model_type(model_type)  # transformers' model swapped for the id's stacked experts
    if model.model_id is None and (wants_moe_model or recorded_router) and promoted and promoted.router_promoted:
        model = replace(model, model_id=promoted.model_id)
    if data.neat_packing and not data.packing:
        data = replace(data, packing=True)
    if data.data_manager_type == "mg" and data.dataset is not None:
        data = replace(data, dataset=dataset_entries(data.dataset))
    if training.global_batch_size is not None:
        dp = parallel_layout(config.parallel, world_size).dp
        training = replace(training, gradient_accumulation_steps=training.global_batch_size
                           // (training.per_device_train_batch_size * dp))
    return normalise_head_fields(normalise_sft(replace(config, model=model, data=data, training=training)))
