"""Qwen3-Next's MTP layout (`model_id qwen3_next`, named by its spec): where its released checkpoints keep the MTP
layers (vLLM `qwen3_next_mtp.py`, transformers' Qwen3.5 MTP code, released Qwen3-Next-80B-A3B keys).

`mtp.pre_fc_norm_embedding` = enorm, `mtp.pre_fc_norm_hidden` = hnorm, `mtp.fc` = eh_proj over cat(normed embedding,
normed hidden) — embedding first, as Megatron —, `mtp.layers.0.*` = the decoder layer, `mtp.norm` = final_layernorm;
the norms are Qwen3-Next's zero-centred RMSNorm (weight stored as w, applied as 1 + w: the model's own norm class,
which `mtp.py` uses). The decoder layer is a *full-attention* layer with the sparse MoE block (whatever the type of
the model's last layer), so it is built from a copy of the config where that layer index is full attention and
sparse; `qwen3_next`'s stacked experts and router are swapped in. It reuses the call arguments (causal mask, rotary)
of the last full-attention main layer. The layout has one fc / norm pair for the whole block, so it holds exactly
one depth (`mtp_num_hidden_layers`, recorded in the config on attach): `model.mtp_num_layers` must be 1 for it
(config validation says so for the model id).
"""
from __future__ import annotations

import copy
from typing import Callable

from torch import nn

from fsdp2_backend.models.mtp_layouts import _OWN, MTPLayout


class Qwen3NextLayout(MTPLayout):
    """Qwen3-Next's released `mtp.*` layout (module docstring)."""

    _PARTS = {"enorm": "mtp.pre_fc_norm_embedding.", "hnorm": "mtp.pre_fc_norm_hidden.", "eh_proj": "mtp.fc.",
              "final_layernorm": "mtp.norm.", "transformer_layer": "mtp.layers.{k}."}

    def checkpoint_name(self, name: str, config) -> str:
        match = _OWN.match(name)
        if match is None:
            return name
        return self._PARTS[match["part"]].format(k=match["k"]) + match["rest"]

    def check(self, config, num_layers: int) -> None:
        if num_layers != 1:
            from fsdp2_backend.usage_errors import UsageError

            raise UsageError(f"model.mtp_num_layers: {num_layers} depths, but Qwen3-Next's MTP layout holds one "
                             f"(one fc / norm pair) — give mtp_num_layers 1")

    def layer_index(self, config) -> int:
        full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
        return full[-1] if full else config.num_hidden_layers - 1

    def layer_factory(self, model: nn.Module) -> Callable[[int], nn.Module]:
        config, cls = model.config, type(model.get_decoder().layers[0])
        index = config.num_hidden_layers - 1
        mtp_config = copy.copy(config)  # shallow: only the per-layer choices of this one index differ
        mtp_config.layer_types = list(config.layer_types)
        mtp_config.layer_types[index] = "full_attention"
        mtp_config.mlp_only_layers = [i for i in config.mlp_only_layers if i != index]
        mtp_config.decoder_sparse_step = 1

        def build(k: int) -> nn.Module:
            layer = cls(mtp_config, index)
            from fsdp2_backend.models.qwen3_next.modeling import Qwen3NextGroupedForCausalLM, _swap_layer

            if isinstance(model, Qwen3NextGroupedForCausalLM):  # model_id qwen3_next: stacked experts, our router
                _swap_layer(mtp_config, layer)
            return layer
        return build

    def record_depth(self, config, num_layers: int) -> None:
        config.mtp_num_hidden_layers = num_layers  # the released config.json's key (vLLM reads it)
