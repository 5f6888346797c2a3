"""Megatron GPT weights (megatron-core's key names, torch_dist's stacked layers or the legacy per-layer keys) in the
HF layout a config describes: Llama / Qwen attention (``linear_qkv``'s grouped rows split into q, k, v), the fused
norms, the gated MLP (``linear_fc1`` = [gate; up]), MoE layers (`moe.py`), MLA attention and MTP layers (`mla.py`).
Reading the files and making the config is `convert.py`'s; this module only renames and splits tensors.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.checkpoint.mla import mla_attention_to_hf, mtp_to_hf
from megatron_compat.checkpoint.moe import moe_layer_to_hf


def _layers(state: dict[str, torch.Tensor], num_layers: int) -> list[dict[str, torch.Tensor]]:
    """Per-layer dicts keyed by the name inside the layer (``self_attention.linear_qkv.weight``), from either
    torch_dist's stacked keys or the legacy per-layer keys."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    for key, value in state.items():
        match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", key)
        if match:
            out[int(match.group(1))][match.group(2)] = value
        elif key.startswith("decoder.layers."):
            if value.shape[0] != num_layers:
                raise UsageError(f"the checkpoint's {key} stacks {value.shape[0]} layers, its args say "
                                 f"{num_layers}")
            for i in range(num_layers):
                out[i][key[len("decoder.layers."):]] = value[i]
    return out


def _first(layer: dict, *names: str) -> Optional[torch.Tensor]:
    for name in names:
        if name in layer:
            return layer[name]
    return None


def _split_qkv(t: torch.Tensor, config) -> tuple[torch.Tensor, ...]:
    """linear_qkv rows: per query group, the group's query heads, then one key and one value head."""
    heads, groups, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_group = heads // groups
    grouped = t.reshape(groups, per_group + 2, head_dim, *t.shape[1:])
    q = grouped[:, :per_group].reshape(heads * head_dim, *t.shape[1:])
    return q, grouped[:, per_group].reshape(groups * head_dim, *t.shape[1:]), \
        grouped[:, per_group + 1].reshape(groups * head_dim, *t.shape[1:])


def _layer_to_hf(layer: dict, p: str, config) -> dict[str, torch.Tensor]:
    """One decoder layer (keys inside the layer) in HF names under prefix ``p`` (the main layers' and MTP's)."""
    out: dict[str, torch.Tensor] = {}
    mla = "self_attention.linear_kv_down_proj.weight" in layer
    if mla:  # q/kv latents and their norms (checkpoint/mla.py)
        out.update(mla_attention_to_hf(layer, p))
    for suffix in ("weight", "bias"):
        qkv = layer.get(f"self_attention.linear_qkv.{suffix}")
        if qkv is not None:
            for proj, part in zip("qkv", _split_qkv(qkv, config)):
                out[f"{p}self_attn.{proj}_proj.{suffix}"] = part.contiguous()
    out[f"{p}self_attn.o_proj.weight"] = layer["self_attention.linear_proj.weight"]
    norms = {"input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
             "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")}
    if not mla:  # an MLA layer's q_layernorm is its q latent's norm (above)
        norms.update({"self_attn.q_norm.weight": ("self_attention.q_layernorm.weight",),
                      "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight",)})
    for hf_name, names in norms.items():
        found = _first(layer, *names)
        if found is not None:
            out[p + hf_name] = found
    if "mlp.router.weight" in layer:  # an MoE layer: router, experts, shared expert
        out.update(moe_layer_to_hf(layer, p, config))
        return out
    gate, up = layer["mlp.linear_fc1.weight"].chunk(2, dim=0)
    out[f"{p}mlp.gate_proj.weight"] = gate.contiguous()
    out[f"{p}mlp.up_proj.weight"] = up.contiguous()
    out[f"{p}mlp.down_proj.weight"] = layer["mlp.linear_fc2.weight"]
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Megatron GPT weights in the HF layout ``config`` describes (Llama / Qwen / their MoE kinds / DeepSeek-V3,
    whose MTP layers come as this project's ``mtp.layers.{k}.*``)."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in state and not config.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i, layer in enumerate(_layers(state, config.num_hidden_layers)):
        out.update(_layer_to_hf(layer, f"model.layers.{i}.", config))
    if getattr(config, "num_nextn_predict_layers", 0):  # MTP layers as models/mtp.py holds them (checkpoint/mla.py)
        out.update(mtp_to_hf(state, config, lambda layer, prefix: _layer_to_hf(layer, prefix, config)))
    return out


__all__ = ["to_hf_state_dict"]
