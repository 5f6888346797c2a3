"""A model's on-disk key layout as transformers itself converts it: for model ids built on a transformers class
whose checkpoints are renamed or per-expert on disk (DeepSeek-V4's native `attn.wq_a` / `ffn.experts.{e}.w1`,
with or without the `model.` prefix; GLM-5.2's and LongCat-Flash's `mlp.experts.{e}.gate_proj`), the streaming
loader asks transformers' own conversion (what `from_pretrained` applies: `get_model_conversion_mapping` and
`rename_source_key`) which in-memory parameter each key of the checkpoint directory (`hf_config._name_or_path`)
becomes, and stacks per-expert tensors in the converter's order (every expert's gate, then every expert's up).

A parameter no key becomes (one this project adds, e.g. LongCat-Flash-Lite's n-gram embeddings) is its own key.
The layout is read once per (class, directory).
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

import torch
from torch import nn


def _natural(key: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


@lru_cache(maxsize=8)
def _layout(hf_class: type, config_json: str, directory: str) -> Dict[str, List[str]]:
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    values = json.loads(config_json)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model: nn.Module = hf_class(config)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    keys = [key for f in sorted(Path(directory).glob("*.safetensors"))
            for key in safe_open(str(f), framework="pt").keys()]
    found: Dict[str, List[Tuple[int, list, str]]] = {}
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        order = 0
        if pattern is not None:  # which of the converter's sources (gate before up)
            order = next(c.source_patterns.index(pattern) for c in converters if pattern in c.source_patterns)
        found.setdefault(target, []).append((order, _natural(key), key))
    return {target: [key for *_, key in sorted(entries)] for target, entries in found.items()}


def _config_json(hf_config) -> str:
    values = hf_config.to_dict()
    values.pop("transformers_version", None)
    return json.dumps(values, sort_keys=True, default=str)


def checkpoint_keys(name: str, hf_config, hf_class: type) -> List[str]:
    """The on-disk keys holding parameter `name` of `hf_class` (itself when no key of the directory becomes it)."""
    directory = getattr(hf_config, "_name_or_path", "") or ""
    if not Path(directory).is_dir():
        return [name]
    return _layout(hf_class, _config_json(hf_config), directory).get(name, [name])


def param_from_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], hf_config, hf_class: type) -> torch.Tensor:
    """The full parameter from its on-disk tensors: renamed ones as they are, per-expert ones stacked
    (`experts.down_proj` (E, H, I); `experts.gate_up_proj` (E, 2I, H): each expert's gate rows, then its up rows)."""
    keys = checkpoint_keys(name, hf_config, hf_class)
    if len(keys) == 1:
        return tensors[keys[0]]
    stacked = torch.stack([tensors[k] for k in keys])
    if name.endswith("gate_up_proj"):  # every expert's gate, then every expert's up
        gate, up = stacked.split(len(keys) // 2)
        return torch.cat([gate, up], dim=1)
    return stacked
