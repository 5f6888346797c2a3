"""Validation of Megatron's µP fields (`model.use_mup`, `model.mup_*`; Megatron-LM's `--use-mup`, `--mup-*`), and
the width multiplier every part of µP reads, torch-free.

Megatron-LM (TransformerConfig.__post_init__) derives width_mult = hidden_size / mup_base_hidden_size (base
defaults to hidden_size) and asserts the base is positive. Here the µP parts live in `models/mup.py` (attention
scale, logit and embedding multipliers, init) and `training/optimizer.py` (Adam lr / eps of hidden matrices);
what they cannot honour is declined here, one line each, before any process group.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

# HF model types whose attention modules take their softmax scale from `module.scaling` and whose weight names
# models/mup.py classifies (hidden matrices, output projections, embeddings).
MUP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gpt2")
_MUP_FIELDS = ("mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
               "mup_attn_scale_power")


def width_mult(model_args: Any, hidden_size: int) -> float:
    """Megatron's mup_width_mult: hidden_size / mup_base_hidden_size (1 when the base is unset)."""
    base = model_args.mup_base_hidden_size or hidden_size
    return hidden_size / base


def output_mult(model_args: Any, hidden_size: int) -> float:
    """The logit multiplier: the given one, else 1 / width_mult (Megatron auto-sets its default 1.0 so)."""
    m = width_mult(model_args, hidden_size)
    if model_args.mup_output_mult is not None and model_args.mup_output_mult != 1.0:
        return model_args.mup_output_mult
    return 1.0 / m


def softmax_scale(model_args: Any, head_dim: int) -> float:
    """Megatron's µP softmax scale: sqrt(mup_base_head_dim or 1) / head_dim ** mup_attn_scale_power."""
    base = 1.0 if model_args.mup_base_head_dim is None else model_args.mup_base_head_dim ** 0.5
    return base / head_dim ** model_args.mup_attn_scale_power


def mup_errors(config: Any, facts: Any) -> List[str]:
    """One line per µP setting this run cannot honour."""
    m = config.model
    defaults: Dict[str, Optional[float]] = {"mup_base_hidden_size": None, "mup_embedding_mult": 1.0,
                                            "mup_output_mult": None, "mup_base_head_dim": None,
                                            "mup_attn_scale_power": 1.0}
    if not m.use_mup:
        return [f"model.{name}: only read with model.use_mup (--use-mup) — set use_mup, or unset {name}"
                for name in _MUP_FIELDS if getattr(m, name) != defaults[name]]
    errors = []
    if m.mup_base_hidden_size is not None and m.mup_base_hidden_size <= 0:
        errors.append(f"model.mup_base_hidden_size (--mup-base-hidden-size): must be positive, got "
                      f"{m.mup_base_hidden_size} — give the base model's hidden size")
    if m.mup_base_head_dim is not None and m.mup_base_head_dim <= 0:
        errors.append(f"model.mup_base_head_dim (--mup-base-head-dim): must be positive, got {m.mup_base_head_dim} "
                      "— give the base model's head dimension")
    model_type = facts.model_type if facts is not None else None
    if m.model_id is not None or (model_type is not None and model_type not in MUP_MODEL_TYPES):
        errors.append(f"model.use_mup (--use-mup): µP is built for transformers' {', '.join(MUP_MODEL_TYPES)} "
                      f"models, not {m.model_id or model_type} — drop --use-mup")
    if m.mtp_num_layers:
        errors.append("model.use_mup (--use-mup): µP with multi-token prediction (MTP layers' init and shared head) "
                      "is not implemented — drop --use-mup or --mtp-num-layers")
    if config.training.optimizer != "adamw":
        errors.append(f"model.use_mup (--use-mup): µP's learning-rate rules are implemented for Adam only, not "
                      f"{config.training.optimizer} — use --optimizer adam, or drop --use-mup")
    return errors
