"""What validation needs to know about the model, read without torch before anything is built.

The model of a run is defined, in this order, by: `model.model_name_or_path` (an HF directory's config.json),
the checkpoint the run resumes from (its `hf_meta/config.json`: `--load CKPT` needs no architecture flags),
and `model.architecture` (HF config keys from Megatron's flags), which overrides or completes the others.
`model_facts(config)` merges them into one `ModelFacts`; `source` says where they came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from fsdp2_backend.checkpoint.resume_point import resume_checkpoint
from fsdp2_backend.config.schema import Config
from fsdp2_backend.config.weight_files import read_config_json


@dataclass(frozen=True)
class ModelFacts:
    """The model's sizes that parallel layouts and fields depend on (None: unknown, not checked)."""

    source: str                      # "hf directory", "checkpoint", "architecture flags" or "" (no model)
    model_type: Optional[str] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    num_layers: Optional[int] = None
    vocab_size: Optional[int] = None
    num_experts: Optional[int] = None
    layer_types: tuple = ()
    config_json: Optional[Dict[str, Any]] = None  # the HF config.json the facts were read from, if any


def _first(values: Dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if values.get(key) is not None:
            return values[key]
    return None


def model_facts(config: Config, errors: List[str]) -> ModelFacts:
    """The model's facts from its definitions (see the module docstring); problems reading them go to `errors`."""
    m = config.model
    base, source = read_config_json(m.model_name_or_path, errors), "hf directory"
    if base is None:
        resume = resume_checkpoint(config)
        if resume.checkpoint is not None:  # its hf_meta/config.json, or the HF config a Megatron-LM one's args describe
            base, source = resume.format.model_config(resume.checkpoint, errors), "checkpoint"
    arch = {k: v for k, v in (m.architecture or {}).items() if v is not None}
    if base is None and not arch:
        # A model path without a config.json here (not there yet, or a hub name) is the loader's to read.
        return ModelFacts(source="model path (not read)" if m.model_name_or_path else "")
    values = {**(base or {}), **arch}
    if base is None:
        source = "architecture flags"
    heads = _first(values, "num_attention_heads", "n_head")
    return ModelFacts(
        source=source, model_type=values.get("model_type"), num_heads=heads,
        num_kv_heads=_first(values, "num_key_value_heads", "num_attention_groups") or heads,  # Step-3.5: groups
        num_layers=_first(values, "num_hidden_layers", "n_layer"), vocab_size=values.get("vocab_size"),
        num_experts=_first(values, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
        layer_types=tuple(values.get("layer_types") or ()), config_json=base)
