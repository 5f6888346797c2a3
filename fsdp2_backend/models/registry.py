"""Model ids → builders: how this project's own model implementations are found.

`model.model_id` unset runs the native transformers causal LM of the HF directory; a model id runs the
builder registered here. A builder takes the HF config and returns an `nn.Module` causal LM whose parameter
names equal the HF checkpoint's keys (so the safetensors loader and the HF export work unchanged) and which
has HF's `_init_weights(module)` for seeded initialisation. Later issues add a model by adding one entry to
`_BUILDERS`.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

from torch import nn

from fsdp2_backend.errors import UsageError

ModelBuilder = Callable[[object], nn.Module]


def _build_qwen3(hf_config) -> nn.Module:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(hf_config)


_BUILDERS: Mapping[str, ModelBuilder] = MappingProxyType({
    "qwen3": _build_qwen3,
})


def registered_model_ids() -> tuple:
    """The model ids that have a builder."""
    return tuple(_BUILDERS)


def model_builder(model_id: str) -> ModelBuilder:
    """The builder for `model_id`; an unknown or not-yet-implemented id is a usage error."""
    if model_id not in _BUILDERS:
        raise UsageError(f"model.model_id: '{model_id}' has no implementation in this project yet — use one of "
                         f"{', '.join(_BUILDERS)} or leave model_id unset to run the transformers model")
    return _BUILDERS[model_id]
