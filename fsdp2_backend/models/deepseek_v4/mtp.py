"""DeepSeek-V4's MTP layers (`model_id deepseek_v4` with `model.mtp_num_layers`): the depth module and the
checkpoint layout `models/mtp.py` / `models/mtp_layouts.py` use for it.

The math is DeepSeek's `MTPBlock` (DeepSeek-V4-Flash's inference/model.py, as MindSpeed-LLM's checkpoint converter
names its tensors), which differs from Megatron's generic depth where the hyper-connections (mHC) are concerned:
- depth 1 takes the main model's `hc_mult` residual streams [B, S, hc, D] *before* the main `hc_head` collapse and
  the final norm; `hnorm` normalises each stream; x = e_proj(enorm(embedding of token t+k)) broadcast over the
  streams + h_proj(hnorm(streams)). `eh_proj` holds [e_proj | h_proj] (Megatron's 2h -> h, embedding first), applied
  to cat(enorm(e) per stream, hnorm(stream)) — the same sum.
- the depth's decoder layer is DeepSeek-V4's own (mHC, sinks, the clamped SwiGLU experts, a top-k MoE: hash routing
  is only for the first main layers), with the attention the checkpoint's `compress_ratios[N + k]` names (0, the
  sliding window, for V4-Flash and V4-Pro; a compressed MTP attention is declined);
- its own `hc_head` (hc_head_fn / base / scale) collapses the streams, its own `norm` (our final_layernorm) normalises,
  and the shared lm head gives the logits. Depth k > 1 takes depth k-1's streams before its hc_head (DeepSeek
  releases one depth; the streams are the only input form its MTPBlock takes).
MindSpeed-LLM's FSDP2 model and its Megatron spec instead collapse the streams with the main hc_head first and
repeat the projected result over the streams; the checkpoint's weights were trained as DeepSeek's model runs them,
which is followed here.

Checkpoint keys (DeepSeek's, `mtp.{k}.*`): `enorm`, `hnorm`, `e_proj`, `h_proj`, `norm`, `hc_head_{fn,base,scale}`
as they are; the decoder layer's keys as DeepSeek names a block (`attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`,
...), read and written through transformers' DeepSeek-V4 conversion like the main layers (models/hf_layout.py on
load; the export's `revert_weight_conversion`, which spells the kv norm `attn.norm` as it does for the main
layers); `mtp.{k}.emb.tok_emb.weight` / `mtp.{k}.head.weight` (copies of the embedding and head, which MindSpeed's
converter may write) are compared with the shared ones on load and not written on export.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Mapping

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dv4

from fsdp2_backend.models import hf_layout
from fsdp2_backend.models.mtp import MTPLayer
from fsdp2_backend.models.mtp_layouts import _OWN, MTPLayout

_DEPTH = re.compile(r"^mtp\.(\d+)\.")
# our part of an MTP depth -> DeepSeek's key under mtp.{k}. (the decoder layer: its own keys, see below)
_DIRECT = {"enorm": "enorm.", "hnorm": "hnorm.", "final_layernorm": "norm.", "eh_proj": "eh_proj.",
           "hc_head": "hc_head_"}
_COPIES = {"emb.tok_emb.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}


class DeepseekV4MTPLayer(MTPLayer):
    """One DeepSeek-V4 MTP depth: Megatron's parts plus the depth's own hc_head (module docstring)."""

    def __init__(self, config, norm_cls: type, make_layer: Callable[[], nn.Module]):
        super().__init__(config, norm_cls, make_layer)
        self.hc_head = dv4.DeepseekV4HyperHead(config).to(torch.float32)

    def forward(self, hidden: Tensor, embedded: Tensor, layer_kwargs: dict):
        """`hidden`: streams [B, S, hc, D]; (the normed collapsed output for the head, the output streams)."""
        normed = self.hnorm(hidden)
        embedded = self.enorm(embedded).unsqueeze(2).expand_as(normed)
        x = self.eh_proj(torch.cat([embedded, normed], dim=-1))
        # the main layer's call arguments without its token ids: they only feed hash routing, which MTP layers lack
        kwargs = {key: value for key, value in layer_kwargs.items() if key != "input_ids"}
        out = self.transformer_layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return self.final_layernorm(self.hc_head(out)), out


def _checkpoint_ratios(config) -> List[int]:
    """DeepSeek's per-layer `compress_ratios` from the checkpoint's config.json (main layers, then MTP layers);
    transformers' config keeps the main layers' only (`layer_types`)."""
    path = Path(getattr(config, "_name_or_path", "") or "") / "config.json"
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("compress_ratios") or [])


class DeepseekV4Layout(MTPLayout):
    """DeepSeek-V4's `mtp.{k}.*` layout and depth module (module docstring)."""

    prenorm_hidden = True  # depth k+1 gets depth k's streams before its hc_head and norm
    depth_class = DeepseekV4MTPLayer

    def hidden_source(self, model: nn.Module) -> nn.Module:
        return model.get_decoder().hc_head  # its input: the main model's streams before the collapse

    def check(self, config, num_layers: int) -> None:
        from fsdp2_backend.usage_errors import UsageError

        have = getattr(config, "num_nextn_predict_layers", 0) or 0
        if have and num_layers > have:
            raise UsageError(f"model.mtp_num_layers: {num_layers} MTP layers but the checkpoint has {have} "
                             f"(num_nextn_predict_layers) — give at most {have}")
        ratios, n = _checkpoint_ratios(config), config.num_hidden_layers
        compressed = [k for k in range(num_layers) if n + k < len(ratios) and ratios[n + k]]
        if compressed:
            raise UsageError(f"model.mtp_num_layers: the checkpoint's MTP layer {compressed[0]} has compressed "
                             f"attention (compress_ratios[{n + compressed[0]}] = {ratios[n + compressed[0]]}), "
                             f"which this layout does not build (DeepSeek-V4's are sliding-window) — unset it")

    def layer_factory(self, model: nn.Module) -> Callable[[int], nn.Module]:
        """DeepSeek-V4's decoder layer at index N + k (DeepSeek's MTP layer id): sliding-window attention, top-k MoE;
        under `model_id deepseek_v4` its experts stacked like the main layers'."""
        from fsdp2_backend.models.deepseek_v4.modeling import DeepseekV4GroupedForCausalLM, _grouped

        config, cls = model.config, type(model.get_decoder().layers[0])

        def build(k: int) -> nn.Module:
            mtp_config = copy.copy(config)  # shallow: only the types of the appended indices differ
            mtp_config.layer_types = list(config.layer_types) + ["sliding_attention"] * (k + 1)
            mtp_config.mlp_layer_types = list(config.mlp_layer_types) + ["moe"] * (k + 1)
            layer = cls(mtp_config, config.num_hidden_layers + k)
            if isinstance(model, DeepseekV4GroupedForCausalLM):
                layer.mlp.experts = _grouped(layer.mlp.experts)
            return layer
        return build

    def record_depth(self, config, num_layers: int) -> None:
        config.num_nextn_predict_layers = num_layers

    def checkpoint_name(self, name: str, config) -> str:
        """`mtp.{k}.` + DeepSeek's name for our direct parts; + transformers' in-memory name for the layer's."""
        match = _OWN.match(name)
        if match is None:
            return name
        rest = match["rest"][len("hc_"):] if match["part"] == "hc_head" else match["rest"]  # hc_fn -> hc_head_fn
        return f"mtp.{match['k']}.{_DIRECT.get(match['part'], '')}{rest}"

    def is_candidate(self, key: str, config, num_layers: int) -> bool:
        match = _DEPTH.match(key)
        return bool(match) and int(match[1]) < num_layers

    def extra_keys(self, config, num_layers: int) -> Dict[str, str]:
        return {f"mtp.{k}.{key}": source for k in range(num_layers) for key, source in _COPIES.items()}

    def exported_copies(self, config, num_layers: int) -> Dict[str, str]:
        return {}  # DeepSeek's model shares the embedding and head; MindSpeed's converter does without them

    def keys(self, flat: str, config) -> List[str]:
        if flat.endswith(".eh_proj.weight"):
            return [flat.replace(".eh_proj.", ".e_proj."), flat.replace(".eh_proj.", ".h_proj.")]
        if re.match(r"^mtp\.\d+\.(enorm|hnorm|norm)\.weight$|^mtp\.\d+\.hc_head_", flat):
            return [flat]
        return hf_layout.checkpoint_keys(flat, config, dv4.DeepseekV4ForCausalLM)

    def assemble(self, flat: str, tensors: Mapping[str, Tensor], config) -> Tensor:
        keys = self.keys(flat, config)
        if flat.endswith(".eh_proj.weight"):
            return torch.cat([tensors[key] for key in keys], dim=1)
        if len(keys) == 1:
            return tensors[keys[0]]
        return hf_layout.param_from_checkpoint(flat, tensors, config, dv4.DeepseekV4ForCausalLM)

    def split(self, flat: str, tensor: Tensor) -> Dict[str, Tensor]:
        """The eh_proj as DeepSeek's e_proj / h_proj; the layer's tensors under transformers' names, which the
        export's `revert_weight_conversion` turns into DeepSeek's (per-expert w1 / w3 / w2 included)."""
        if flat.endswith(".eh_proj.weight"):
            e, h = tensor.chunk(2, dim=1)
            return {flat.replace(".eh_proj.", ".e_proj."): e.contiguous(),
                    flat.replace(".eh_proj.", ".h_proj."): h.contiguous()}
        return {flat: tensor}
