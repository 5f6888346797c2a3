"""Step-3.5's MTP layout (`model_id step35`, named by its spec): its MTP layers appended to `model.layers`, as
DeepSeek-V3's (`mtp_layouts.TrailingLayersLayout`), with Step-3.5's own head keys and layer choices.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Mapping

import torch
from torch import nn

from fsdp2_backend.models.mtp_layouts import TrailingLayersLayout


class Step35Layout(TrailingLayersLayout):
    """Step-3.5's MTP layers: the checkpoint's `model.layers.{N + k}` (N = num_hidden_layers; vLLM `step3p5_mtp.py`):
    `enorm`, `hnorm`, `eh_proj` (over cat(normed embedding, normed hidden)), the decoder layer's own keys directly
    under the layer, `transformer.shared_head.norm` = final_layernorm and `transformer.shared_head.output` (a copy
    of the lm head: written on export; on load, Megatron's shared head is used and a different copy is reported).
    The norms are the model's zero-centred RMSNorm. Unlike Megatron, Step-3.5's model feeds depth 1 the main
    hidden states *before* the final norm (vLLM's Step3p5ForCausalLM applies `model.norm` only in compute_logits)
    and depth k the output of depth k-1 before its `shared_head.norm`: followed here (`prenorm_hidden`). The MTP
    layer's attention type and MLP are the config's `mtp_layer_types` / `mtp_mlp_layer_types` (Step-3.5-Flash:
    dense MLP); it is built at the index of the last main layer of that attention type (same heads and rotary),
    with a dense MLP there; its SwiGLU clamp limit is not kept by transformers' config (none is applied)."""

    prenorm_hidden = True
    head_norm = "transformer.shared_head.norm."
    copies = {"transformer.shared_head.output.weight": "lm_head.weight"}

    def _types(self, config, num_layers: int):
        attn = list(getattr(config, "mtp_layer_types", None) or ["full_attention"] * num_layers)
        mlp = list(getattr(config, "mtp_mlp_layer_types", None) or ["dense"] * num_layers)
        return attn[:num_layers], mlp[:num_layers]

    def check(self, config, num_layers: int) -> None:
        from fsdp2_backend.usage_errors import UsageError

        super().check(config, num_layers)
        attn, mlp = self._types(config, num_layers)
        if "sparse" in mlp:
            raise UsageError("model.mtp_num_layers: the checkpoint's Step-3.5 MTP layers have MoE MLPs, which this "
                             "layout does not map (Step-3.5-Flash's are dense) — unset mtp_num_layers")
        if len(set(attn)) > 1 or attn[0] not in config.layer_types:
            raise UsageError(f"model.mtp_num_layers: Step-3.5 MTP layers of attention types {attn} need one type "
                             f"that a main layer also has — unset mtp_num_layers")

    def layer_index(self, config) -> int:
        kind = (getattr(config, "mtp_layer_types", None) or ["full_attention"])[0]
        return max(i for i, t in enumerate(config.layer_types) if t == kind)

    def layer_factory(self, model: nn.Module) -> Callable[[int], nn.Module]:
        config, cls = model.config, type(model.get_decoder().layers[0])
        index = self.layer_index(config)
        mtp_config = copy.copy(config)  # shallow: only the MLP choice at this index differs
        mtp_config.mlp_layer_types = list(config.mlp_layer_types)
        mtp_config.mlp_layer_types[index] = "dense"
        if config.swiglu_limits_shared:
            mtp_config.swiglu_limits_shared = list(config.swiglu_limits_shared)
            mtp_config.swiglu_limits_shared[index] = 0  # 0: no clamp (transformers' Step3p7MLP)
        return lambda k: cls(mtp_config, index)

    def record_depth(self, config, num_layers: int) -> None:
        super().record_depth(config, num_layers)
        config.mtp_num_layers = num_layers  # step35_legacy_config writes num_nextn_predict_layers from it

    def keys(self, flat: str, config) -> List[str]:
        return [flat]  # dense MTP layers only (check)

    def assemble(self, flat: str, tensors: Mapping[str, torch.Tensor], config) -> torch.Tensor:
        return tensors[flat]

    def split(self, flat: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {flat: tensor}
