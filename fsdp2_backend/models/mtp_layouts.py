"""Where a Hugging Face checkpoint keeps its MTP layers, and how they map onto this project's MTP modules.

`models/mtp.py` holds the MTP layers as `mtp.layers.{k}.{enorm, hnorm, eh_proj, transformer_layer.*,
final_layernorm}` (Megatron's names), whatever the model. Checkpoints released with MTP layers name them their
own way; a `MTPLayout` maps each of our names to the checkpoint's (one direction, enough for both ways: loading
walks our parameters, exporting walks our state dict), and says how the MTP decoder layer is built and which
main layer's call arguments it reuses. Stacked experts (`mlp.experts.gate_up_proj` / `down_proj`) are split into
and assembled from transformers' per-expert keys (`qwen3_moe.checkpoint_keys` / `param_to_checkpoint`), as for
the main layers, so the on-disk layout is the released one.

Layouts (the checkpoint's model decides the facts; Megatron's semantics of `models/mtp.py` hold for all), each
named by the spec of the id whose checkpoints keep it (`mtp_layout`, models/<id>/spec.py; `mtp_layout(config)`
picks by the config's model type); the generic ones live here, a model's own in its folder:
- own (`qwen3`, anything without a released layout): `mtp.layers.{k}.*` as in memory — this project's export.
- DeepSeek-V3: the MTP layers appended to `model.layers` (`TrailingLayersLayout`); Step-3.5 the same with its own
  head keys (models/step35/mtp.py); Qwen3-Next: `mtp.*`, one depth (models/qwen3_next/mtp.py); DeepSeek-V4:
  `mtp.{k}.*` with its own depth module (mHC streams; models/deepseek_v4/mtp.py).
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from fsdp2_backend.models.qwen3_moe.modeling import checkpoint_keys as expert_keys
from fsdp2_backend.models.qwen3_moe.modeling import param_from_checkpoint as expert_param
from fsdp2_backend.models.qwen3_moe.modeling import param_to_checkpoint as expert_split

_OWN = re.compile(r"^mtp\.layers\.(?P<k>\d+)\.(?P<part>enorm|hnorm|eh_proj|final_layernorm|transformer_layer|hc_head)\."
                  r"(?P<rest>.*)$")


class MTPLayout:
    """This project's own layout (`mtp.layers.{k}.*` as in memory); the base of the released ones."""

    prenorm_hidden = False  # Megatron: depth 1 gets the final-normed hidden states, depth k depth k-1's normed output
    depth_class = None  # the module of one depth: None is Megatron's `mtp.MTPLayer`

    def hidden_source(self, model: nn.Module) -> Optional[nn.Module]:
        """The module whose input is depth 1's hidden state (None: the lm head's input, the final-normed states)."""
        return model.get_decoder().norm if self.prenorm_hidden else None

    def check(self, config, num_layers: int) -> None:
        """Declines (UsageError) an MTP depth or checkpoint this layout cannot hold."""

    def extra_keys(self, config, num_layers: int) -> Dict[str, str]:
        """Checkpoint keys the layout knows but our modules do not hold → the model tensor they copy."""
        return {}

    def exported_copies(self, config, num_layers: int) -> Dict[str, str]:
        """The `extra_keys` the export writes (copies of the model tensor they name)."""
        return self.extra_keys(config, num_layers)

    def checkpoint_name(self, name: str, config) -> str:
        """The checkpoint name of our MTP tensor `name` (`mtp.layers.{k}....`), before any per-expert split."""
        return name

    def is_mtp_key(self, key: str, config) -> bool:
        """Whether checkpoint key `key` belongs to the MTP layers in this layout."""
        return key.startswith("mtp.")

    def layer_index(self, config) -> int:
        """The main decoder layer whose call arguments (mask, rotary, CP arguments) the MTP layers reuse, and whose
        index the MTP decoder layer is built with: the last one."""
        return config.num_hidden_layers - 1

    def layer_factory(self, model: nn.Module) -> Callable[[int], nn.Module]:
        """Builds the MTP decoder layer of depth k (0-based): the model's own decoder-layer class at `layer_index`."""
        cls = type(model.get_decoder().layers[0])
        return lambda k: cls(model.config, self.layer_index(model.config))

    def record_depth(self, config, num_layers: int) -> None:
        """Writes the MTP depth into the HF config the way the checkpoint's model declares it (none here)."""

    def is_candidate(self, key: str, config, num_layers: int) -> bool:
        """Whether `key` is an MTP tensor this run must account for (others are left out with one line)."""
        return self.is_mtp_key(key, config)

    # stacked experts: transformers' per-expert keys on disk, as the main layers of these models
    def keys(self, flat: str, config) -> List[str]:
        return expert_keys(flat, _num_experts(config))

    def assemble(self, flat: str, tensors: Mapping[str, torch.Tensor], config) -> torch.Tensor:
        return expert_param(flat, tensors, _num_experts(config))

    def split(self, flat: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        return expert_split(flat, tensor)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class TrailingLayersLayout(MTPLayout):
    """DeepSeek-V3's MTP layers (transformers' `deepseek_v3`, `num_nextn_predict_layers`; DeepSeek's and vLLM's
    `deepseek_mtp.py`): the checkpoint's `model.layers.{N + k}` (N = num_hidden_layers) with `enorm`, `hnorm`,
    `eh_proj` over cat(normed embedding, normed hidden), the decoder layer's own keys (an MoE layer: per-expert
    keys, `mlp.gate.e_score_correction_bias`) directly under the layer, `shared_head.norm` = final_layernorm, and
    copies of the shared `embed_tokens` and output head (`shared_head.head`): written on export; on load the
    main model's are used (Megatron's shared embedding and head) and a copy that differs is reported. Depth 1 gets
    the final-normed hidden states, as in Megatron and vLLM's DeepSeek model (its model returns normed states)."""

    head_norm = "shared_head.norm."
    copies = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}

    def check(self, config, num_layers: int) -> None:
        from fsdp2_backend.usage_errors import UsageError

        have = getattr(config, "num_nextn_predict_layers", 0) or 0
        if have and num_layers > have:
            raise UsageError(f"model.mtp_num_layers: {num_layers} MTP layers but the checkpoint has {have} "
                             f"(num_nextn_predict_layers) — give at most {have}")

    def checkpoint_name(self, name: str, config) -> str:
        match = _OWN.match(name)
        if match is None:
            return name
        part = {"transformer_layer": "", "final_layernorm": self.head_norm}.get(match["part"], match["part"] + ".")
        return f"model.layers.{config.num_hidden_layers + int(match['k'])}.{part}{match['rest']}"

    def is_mtp_key(self, key: str, config) -> bool:
        match = _LAYER.match(key)
        return bool(match) and int(match[1]) >= config.num_hidden_layers

    def is_candidate(self, key: str, config, num_layers: int) -> bool:
        match = _LAYER.match(key)
        return bool(match) and config.num_hidden_layers <= int(match[1]) < config.num_hidden_layers + num_layers

    def layer_factory(self, model: nn.Module) -> Callable[[int], nn.Module]:
        """The model's decoder layer; under `model_id deepseek_v3` its MoE block swapped like the main layers'
        (`moe/family_swap.py`: stacked experts, the project's router)."""
        base, family = super().layer_factory(model), getattr(model, "_family", None)
        if family is None:
            return base

        def build(k: int) -> nn.Module:
            from fsdp2_backend.models.moe.family_swap import swap_blocks

            layer = base(k)
            swap_blocks(layer, family, model.config)
            return layer
        return build

    def extra_keys(self, config, num_layers: int) -> Dict[str, str]:
        n = config.num_hidden_layers
        return {f"model.layers.{n + k}.{key}": source for k in range(num_layers) for key, source in self.copies.items()}

    def record_depth(self, config, num_layers: int) -> None:
        config.num_nextn_predict_layers = num_layers


def mtp_layout(config) -> MTPLayout:
    """The layout for an HF config: the released one of its model type (the `mtp_layout` of the spec that builds
    it, `models/<id>/spec.py`), else this project's own."""
    from fsdp2_backend.models.registry import spec_for_model_type
    from fsdp2_backend.models.spec import resolve

    spec = spec_for_model_type(getattr(config, "model_type", None))
    return (resolve(spec.mtp_layout) if spec is not None and spec.mtp_layout else MTPLayout)()


def _num_experts(config) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def checkpoint_keys(name: str, config) -> List[str]:
    """The checkpoint keys that hold our MTP tensor `name` (several for stacked experts)."""
    layout = mtp_layout(config)
    return layout.keys(layout.checkpoint_name(name, config), config)


def from_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], config) -> torch.Tensor:
    """Our full MTP tensor `name` from its checkpoint tensors (`checkpoint_keys`)."""
    layout = mtp_layout(config)
    return layout.assemble(layout.checkpoint_name(name, config), tensors, config)


def to_checkpoint(state_dict: Mapping[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """`state_dict` (the full model's, as the HF export gathers it) with our MTP tensors under the checkpoint's
    own names (per-expert keys for stacked experts); other keys unchanged. The identity for the own layout."""
    layout = mtp_layout(config)
    if type(layout) is MTPLayout:
        return dict(state_dict)
    out: Dict[str, torch.Tensor] = {}
    depths = set()
    for key, tensor in state_dict.items():
        match = _OWN.match(key)
        if match:
            depths.add(match["k"])
            out.update(layout.split(layout.checkpoint_name(key, config), tensor))
        else:
            out[key] = tensor
    for key, source in layout.exported_copies(config, len(depths)).items():
        tied = state_dict.get(source, state_dict.get("model.embed_tokens.weight"))  # a tied head: the embedding
        out[key] = tied.clone()  # a copy of its own: not deduplicated as a tied weight
    return out


def load_from_checkpoint(own: Dict[str, torch.Tensor], read: Callable[[str], torch.Tensor], keys: List[str],
                         config, optional: frozenset = frozenset(),
                         model_tensor: Optional[Callable[[str], torch.Tensor]] = None,
                         ) -> Optional[Dict[str, torch.Tensor]]:
    """Our MTP state (`own` names → full tensors) read from a checkpoint holding `keys` (`read(key)` gives one):
    None when the checkpoint holds no MTP tensor of this layout; a problem (missing / unexpected names) raises.
    Names in `optional` (buffers such as Megatron's router state) may be absent."""
    from fsdp2_backend.usage_errors import UsageError

    layout = mtp_layout(config)
    present = set(keys)
    depth = _depth(own)
    candidates = {key for key in keys if layout.is_candidate(key, config, depth)}
    beyond = [key for key in keys if layout.is_mtp_key(key, config) and key not in candidates]
    if beyond and candidates:
        print(f"multi-token prediction: {len(beyond)} tensors of the checkpoint's MTP layers beyond the first "
              f"{depth} are not loaded (model.mtp_num_layers {depth})", flush=True)
    if not candidates:
        return None
    found, missing, used = {}, [], set()
    for name in own:
        if name in present:  # the in-memory layout as it is (e.g. stacked experts saved stacked)
            found[name] = read(name)
            used.add(name)
            continue
        wanted = checkpoint_keys(name, config)
        if all(key in present for key in wanted):
            found[name] = from_checkpoint(name, {key: read(key) for key in wanted}, config)
            used.update(wanted)
        elif name not in optional:
            missing.append(name)
    if not found:  # MTP tensors of some other layout: not ours to guess
        print(f"multi-token prediction: {len(candidates)} MTP tensors of the checkpoint have a layout other than "
              f"{type(layout).__name__}'s and are not loaded; the MTP layers start from their seeded "
              f"initialisation", flush=True)
        return None
    for key, source in layout.extra_keys(config, depth).items():
        if key in present:
            used.add(key)
            if model_tensor is not None and not torch.equal(read(key), model_tensor(source).to(read(key).dtype)):
                print(f"multi-token prediction: {key} differs from {source}; the MTP layers use {source} "
                      f"(Megatron's shared output head)", flush=True)
    unexpected = sorted(candidates - used)
    if missing or unexpected:
        raise UsageError(f"model.mtp_num_layers: the MTP tensors of the checkpoint do not fit the "
                         f"{type(layout).__name__} of {_depth(own)} MTP layers (missing {sorted(missing)[:3]}, "
                         f"unexpected {unexpected[:3]}) — set mtp_num_layers to the checkpoint's depth")
    return found


def _depth(own: Mapping[str, torch.Tensor]) -> int:
    return len({m["k"] for m in map(_OWN.match, own) if m})
