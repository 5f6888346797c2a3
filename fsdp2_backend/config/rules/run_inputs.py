"""Validation rules for the inputs that used to fail late (a traceback at the first step or the first save) or,
worse, be quietly overridden: checked with the others, before any process group, without torch.

`check_run_inputs(config, facts, errors)` adds one message per problem:
- values no run can use: a negative (or NaN) lr, clip norm or weight decay, Adam betas outside [0, 1), a seed
  numpy refuses, negative data loader workers, a split whose weights give no training
  data, an exit_signal that names no signal;
- contradictory fields: gradient_accumulation_steps against the global batch, warmup_ratio against
  lr_warmup_iters / lr_warmup_samples (the explicit count would silently win);
- the model's shape: hidden size against heads (no head_dim), heads against key/value heads, the sequence
  against a learned position table (GPT-2's n_positions), an HF config.json missing the keys transformers would
  otherwise fill with another model's defaults (a missing vocab_size became Qwen3's 151,936), a truncated or
  corrupt safetensors file (`weight_files`);
- the save directory: it must be (or become) a writable directory, found now rather than at the first save.

`canonical_key` names an HF config key the same way whatever the family spells it (GPT-2's n_layer is
num_hidden_layers), so architecture flags are checked against any config.json.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional

from fsdp2_backend.config.model_facts import ModelFacts
from fsdp2_backend.config.layout import parallel_layout
from fsdp2_backend.config.schema import Config, TrainingArguments
from fsdp2_backend.config.signal_names import resolve_signal
from fsdp2_backend.config.weight_files import weight_file_problems
from fsdp2_backend.models.registry import spec_for_model_type

# GPT-2-family spellings of the common HF config keys (transformers' GPT2Config.attribute_map, and the names
# the Megatron translation writes for GPT-style flags).
_ALIASES = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
            "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
            "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act",
            "attn_pdrop": "attention_dropout", "resid_pdrop": "hidden_dropout", "n_ctx": "max_position_embeddings"}

# Keys without which transformers builds the model from its own defaults for the model type.
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

_DEFAULT_WARMUP_RATIO = TrainingArguments().warmup_ratio


def canonical_key(key: str) -> str:
    return _ALIASES.get(key, key)


def canonical_config(values: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """An HF config dict with every key under its canonical name (explicit canonical keys win)."""
    out: Dict[str, Any] = {}
    for key, value in (values or {}).items():
        if canonical_key(key) != key and canonical_key(key) in (values or {}):
            continue
        out[canonical_key(key)] = value
    return out


def check_run_inputs(config: Config, facts: ModelFacts, world_size: int, errors: List[str]) -> None:
    _check_values(config, errors)
    _check_contradictions(config, world_size, errors)
    _check_model_shape(config, facts, errors)
    check_save_dir(config, errors)


def _check_values(config: Config, errors: List[str]) -> None:
    t, d = config.training, config.data
    if not t.lr >= 0:  # also NaN
        errors.append(f"training.lr: must be >= 0, got {t.lr} (Megatron --lr) — give the peak learning rate")
    for name, flag in (("max_grad_norm", "--clip-grad"), ("weight_decay", "--weight-decay")):
        if not getattr(t, name) >= 0:
            errors.append(f"training.{name}: must be >= 0, got {getattr(t, name)} (Megatron {flag})")
    for name, flag in (("adam_beta1", "--adam-beta1"), ("adam_beta2", "--adam-beta2")):
        if not 0 <= getattr(t, name) < 1:
            errors.append(f"training.{name}: must lie in [0, 1), got {getattr(t, name)} (Megatron {flag})")
    if not t.adam_epsilon > 0:
        errors.append(f"training.adam_epsilon: must be positive, got {t.adam_epsilon} (Megatron --adam-eps)")
    if not 0 <= t.seed < 2**32:
        errors.append(f"training.seed: must lie in [0, 2**32) (numpy's seeds), got {t.seed} (Megatron --seed)")
    if t.dataloader_num_workers < 0:
        errors.append(f"training.dataloader_num_workers: must be >= 0 (0 loads in the main process), got "
                      f"{t.dataloader_num_workers} (Megatron --num-workers)")
    if t.dataloader_prefetch_factor is not None and t.dataloader_prefetch_factor < 1:
        errors.append(f"training.dataloader_prefetch_factor: must be at least 1, got {t.dataloader_prefetch_factor}")
    if t.exit_signal_handler and resolve_signal(t.exit_signal) is None:
        errors.append(f"training.exit_signal: {t.exit_signal!r} is no signal — give a name such as SIGTERM or "
                      f"SIGUSR1, or its number (Megatron --exit-signal)")
    if t.eval_iters < 0:
        errors.append(f"training.eval_iters: must be >= 0, got {t.eval_iters} (Megatron --eval-iters)")
    if d.data_manager_type == "mg" and not (d.train_data_path or d.valid_data_path or d.test_data_path):
        try:
            weights = [float(part) for part in re.split(r"[,/]", d.split) if part.strip()]
        except ValueError:
            return  # the generic split rule reports it
        if any(w < 0 for w in weights):
            errors.append(f"data.split: {d.split!r} has a negative weight — give non-negative weights such as "
                          f"969,30,1 (Megatron --split)")
        elif weights and not weights[0]:
            errors.append(f"data.split: {d.split!r} gives the training split no documents — give it a positive "
                          f"weight such as 969,30,1 (Megatron --split)")


def _check_contradictions(config: Config, world_size: int, errors: List[str]) -> None:
    t = config.training
    if t.global_batch_size is not None and t.gradient_accumulation_steps != 1 and t.per_device_train_batch_size > 0:
        dp = parallel_layout(config.parallel, world_size).dp
        derived = t.global_batch_size // max(t.per_device_train_batch_size * dp, 1)
        if derived != t.gradient_accumulation_steps:
            errors.append(f"training.gradient_accumulation_steps: {t.gradient_accumulation_steps} contradicts "
                          f"global_batch_size {t.global_batch_size} (= micro batch {t.per_device_train_batch_size} "
                          f"x data-parallel {dp} x {derived} steps) — give only one of them")
    warmup_counts = [name for name in ("lr_warmup_iters", "lr_warmup_samples") if getattr(t, name)]
    if warmup_counts and t.warmup_ratio not in (0.0, _DEFAULT_WARMUP_RATIO):
        errors.append(f"training.warmup_ratio: {t.warmup_ratio} contradicts training.{warmup_counts[0]} "
                      f"{getattr(t, warmup_counts[0])} (Megatron refuses --lr-warmup-fraction with "
                      f"--lr-warmup-iters) — give only one of them")


def _check_model_shape(config: Config, facts: ModelFacts, errors: List[str]) -> None:
    arch = {k: v for k, v in (config.model.architecture or {}).items() if v is not None}
    base = canonical_config(facts.config_json)
    values = {**base, **canonical_config(arch)}
    if facts.source == "hf directory" and facts.config_json is not None:
        path = os.path.join(config.model.model_name_or_path, "config.json")
        if not values.get("model_type") and not facts.config_json.get("architectures"):
            errors.append(f"{path}: no model_type — transformers cannot tell which model this is; add "
                          f"\"model_type\" (e.g. \"qwen3\")")
        spec = spec_for_model_type(values.get("model_type"))  # SSMs: no attention heads (and ids declaring none)
        attention_free = values.get("model_type") in ("mamba", "mamba2") or bool(spec and spec.attention_free)
        missing = [key for key in REQUIRED_CONFIG_KEYS if key not in values
                   and not (attention_free and key == "num_attention_heads")
                   and not (key == "num_hidden_layers" and "num_layers" in values)]  # LongCat-Flash: 2 per layer
        if missing:
            errors.append(f"{path}: no {', '.join(missing)} — transformers would fill in the defaults of "
                          f"{values.get('model_type') or 'its model type'} (another model's sizes); add "
                          f"{'it' if len(missing) == 1 else 'them'} to config.json")
        if not config.model.train_from_scratch:
            errors += weight_file_problems(config.model.model_name_or_path)
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads")
    ints = all(isinstance(v, int) and v > 0 for v in (hidden, heads))
    if ints and values.get("head_dim") is None and hidden % heads:
        errors.append(f"model.architecture.hidden_size: {hidden} is not divisible by num_attention_heads {heads} "
                      f"(and no head_dim is given) — change one of them (Megatron --hidden-size / "
                      f"--num-attention-heads) or give head_dim (--kv-channels)")
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        errors.append(f"model.architecture.num_key_value_heads: {kv_heads} does not divide num_attention_heads "
                      f"{heads} — use a divisor (Megatron --num-query-groups)")
    positions = values.get("max_position_embeddings")
    learned = values.get("model_type") == "gpt2"  # a learned position table: longer sequences index past it
    if learned and isinstance(positions, int) and config.data.cutoff_len > positions:
        errors.append(f"data.cutoff_len: {config.data.cutoff_len} exceeds the model's {positions} learned "
                      f"positions (max_position_embeddings) — shorten the sequence (Megatron --seq-length)")
    d = config.data
    if learned and d.data_manager_type == "mg" and d.reset_attention_mask and not d.reset_position_ids:
        # data/pretrain.py restarts the positions at each document, which equals Megatron's running positions
        # under a per-document mask for rotary (relative) positions only
        errors.append("data.reset_attention_mask: per-document attention with running positions is built for "
                      "rotary positions only; this model has learned absolute positions — add "
                      "data.reset_position_ids (Megatron --reset-position-ids) too")


def check_save_dir(config: Config, errors: List[str]) -> None:
    """The save directory is a directory this process can create and write (torch-free; the startup probe
    in `training.save_dir_guard` then writes a file there)."""
    t = config.training
    if not (t.save_checkpoints and t.output_dir):
        return
    path = os.path.abspath(t.output_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        errors.append(f"training.output_dir (--save): {t.output_dir} is a file, not a directory — give a directory")
        return
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        errors.append(f"training.output_dir (--save): {existing} is a file, so {t.output_dir} cannot be created "
                      f"— give a directory path")
    elif not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        errors.append(f"training.output_dir (--save): {t.output_dir} {what} by this user — give a writable "
                      f"directory")
