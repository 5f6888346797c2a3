"""MindSpeed-LLM's MLA latent scales (`--enable-mla-scale-q-lora` / `--enable-mla-scale-kv-lora`; `model.mla_scale_*`).

MindSpeed multiplies multi-latent attention's compressed query, after its RMSNorm (q_a_layernorm) and before the
up-projection, by s_q = sqrt(hidden_size / q_lora_rank), and the normalised key/value latent (after
kv_a_layernorm, before kv_b_proj) by s_kv = sqrt(hidden_size / kv_lora_rank)
(mindspeed_llm/tasks/models/transformer/multi_latent_attention.py). The up-projections have no bias, so
W·(s·x) = (s·W)·x:
- in training the factor is a forward pre-hook on `q_b_proj` / `kv_b_proj` (the weights stay the ones trained,
  as in MindSpeed, so the optimizer sees the same parameters);
- the HF export folds it into those weights (`fold_scales`), so transformers' model computes the same logits.
`scale_targets` names the folded weights; the model keeps them at `model.mla_lora_scales` for the exporter.
transformers' LongCat-Flash attention applies both factors itself (always): nothing is added there.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
from torch import nn

from fsdp2_backend.usage_errors import UsageError

SCALES_ATTR = "mla_lora_scales"  # {in-memory weight name: factor}, read by checkpoint/hf_shards.py


def _config_of(model: nn.Module):
    return getattr(model, "config", None)


def _builtin(attn: nn.Module) -> bool:
    """transformers' LongCat-Flash MLA multiplies by both factors in its own forward."""
    return hasattr(attn, "mla_scale_q_lora") and hasattr(attn, "mla_scale_kv_lora")


def _mla_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "kv_b_proj", None), nn.Module) and hasattr(m, "kv_a_layernorm")]


def scale_targets(model: nn.Module, q_lora: bool, kv_lora: bool) -> Dict[str, float]:
    """{up-projection module name: factor} for the MLA attentions of `model` (empty when neither is asked).
    A model without MLA, or a q scale on an attention without a query latent, is a usage error."""
    if not (q_lora or kv_lora):
        return {}
    config = _config_of(model)
    text_config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    hidden = getattr(text_config, "hidden_size", None)
    found = _mla_modules(model)
    flag = "model.mla_scale_q_lora" if q_lora else "model.mla_scale_kv_lora"
    if not found or hidden is None:
        raise UsageError(f"{flag}: the model has no multi-latent attention (q_a_layernorm → q_b_proj, "
                         f"kv_a_layernorm → kv_b_proj) to scale — drop the flag, or train an MLA model")
    targets: Dict[str, float] = {}
    for name, attn in found:
        if _builtin(attn):
            continue
        prefix = f"{name}." if name else ""
        if q_lora:
            q_b, q_norm = getattr(attn, "q_b_proj", None), getattr(attn, "q_a_layernorm", None)
            if q_b is None or q_norm is None:
                raise UsageError("model.mla_scale_q_lora: the model's MLA has no query latent (q_lora_rank unset), "
                                 "so there is nothing to scale (MindSpeed fails on it too) — drop the flag")
            targets[prefix + "q_b_proj"] = (hidden / q_b.in_features) ** 0.5
        if kv_lora:
            targets[prefix + "kv_b_proj"] = (hidden / attn.kv_b_proj.in_features) ** 0.5
    return targets


def builtin_note(model: nn.Module, q_lora: bool, kv_lora: bool) -> str:
    """The one-line notice when the model's attention already applies the factors (else "")."""
    if (q_lora or kv_lora) and any(_builtin(m) for _, m in _mla_modules(model)):
        return ("model.mla_scale_q_lora / mla_scale_kv_lora: no effect — transformers' LongCat-Flash attention "
                "already multiplies both latents by sqrt(hidden_size / lora rank), always")
    return ""


def _pre_hook(factor: float):
    def hook(module, args, kwargs):
        return (args[0] * factor,) + tuple(args[1:]), kwargs
    return hook


def record_scales(model: nn.Module, q_lora: bool, kv_lora: bool) -> Dict[str, float]:
    """Records on `model` the weights an export folds the factors into (`SCALES_ATTR`); returns the targets."""
    targets = scale_targets(model, q_lora, kv_lora)
    setattr(model, SCALES_ATTR, {f"{name}.weight": factor for name, factor in targets.items()})
    return targets


def apply_mla_lora_scales(model: nn.Module, q_lora: bool, kv_lora: bool) -> Dict[str, float]:
    """Registers the scaling pre-hooks and records the weights to fold at export; returns the targets."""
    targets = record_scales(model, q_lora, kv_lora)
    modules = dict(model.named_modules())
    for name, factor in targets.items():
        modules[name].register_forward_pre_hook(_pre_hook(factor), with_kwargs=True)
    return targets


def fold_scales(tensors: Mapping[str, torch.Tensor], scales: Mapping[str, float] | None) -> Dict[str, torch.Tensor]:
    """`tensors` with each named up-projection weight multiplied by its factor (in its own dtype's arithmetic
    done in float32, then cast back), for an export that needs no hook."""
    out = dict(tensors)
    for key, factor in (scales or {}).items():
        if key in out:
            weight = out[key]
            out[key] = (weight.float() * factor).to(weight.dtype)
    return out
