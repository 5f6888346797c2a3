"""Model ids → how to build, load and configure this project's own model implementations.

`model.model_id` unset runs the native transformers causal LM of the HF directory; a model id runs the
`ModelSpec` registered here. A spec's `build(hf_config)` returns an `nn.Module` causal LM with HF's
`_init_weights(module)` (seeded initialisation). Its parameters are named like the HF checkpoint's keys
unless the spec says otherwise: `checkpoint_keys(name, hf_config)` lists the keys holding a parameter and
`from_checkpoint(name, tensors, hf_config)` assembles it (e.g. per-expert tensors → stacked experts).
`configure(model, config, device_type)` applies the run's switches (e.g. MoE kernels; the device type is
the build step's, so model code never probes the device). Later issues add a model by adding
one entry to `_SPECS`. Importing this module does not import torch (config validation lists the ids).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional

from fsdp2_backend.config.schema import MODEL_ID_ALIASES
from fsdp2_backend.models.newer_ids import newer_specs
from fsdp2_backend.usage_errors import UsageError

if TYPE_CHECKING:  # torch stays out of this module's imports: config validation reads the model ids
    import torch
    from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """How the engine builds, loads and configures one model id."""

    build: Callable[[object], "nn.Module"]
    checkpoint_keys: Optional[Callable[[str, object], List[str]]] = None
    from_checkpoint: Optional[Callable[[str, Mapping[str, "torch.Tensor"], object], "torch.Tensor"]] = None
    configure: Optional[Callable[["nn.Module", object, str], None]] = None  # (model, config, device type)
    # registers the model's own config class with transformers' AutoConfig before a config.json is read
    register_hf: Optional[Callable[[], None]] = None
    # a tensor stored under the parameter's own name in another layout (MindSpeed's merged experts) → the model's
    stored_layout: Optional[Callable[[str, "torch.Tensor", object], "torch.Tensor"]] = None


def _lazy(module: str, name: str, *, drop_config: bool = False) -> Callable:
    """`fsdp2_backend.models.<module>.<name>`, imported at the first call (this module imports no torch);
    `drop_config`: called without the trailing hf_config argument the engine passes."""
    def call(*args):
        function = getattr(importlib.import_module(f"fsdp2_backend.models.{module}"), name)
        return function(*(args[:-1] if drop_config else args))
    return call


def _module_spec(module: str, build: str, **fields) -> ModelSpec:
    """The spec of a model module with `build(hf_config)`, `checkpoint_keys(name, hf_config)` and
    `param_from_checkpoint(name, tensors, hf_config)`; `fields` replaces any of the spec's entries."""
    return ModelSpec(**{"build": _lazy(module, build), "checkpoint_keys": _lazy(module, "checkpoint_keys"),
                        "from_checkpoint": _lazy(module, "param_from_checkpoint"), **fields})


def _build_qwen3(hf_config) -> nn.Module:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(hf_config)


def _qwen3_moe_keys(name: str, hf_config) -> List[str]:
    from fsdp2_backend.models.qwen3_moe.modeling import checkpoint_keys

    return checkpoint_keys(name, hf_config.num_experts)


def _qwen3_moe_param(name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    from fsdp2_backend.models.qwen3_moe.modeling import param_from_checkpoint

    return param_from_checkpoint(name, tensors, hf_config.num_experts)


def _configure_qwen3_moe(model: nn.Module, config, device_type: str) -> None:  # noqa: ARG001 — the hooks' signature
    from fsdp2_backend.models.qwen3_moe.modeling import configure_moe

    configure_moe(model, moe_grouped_gemm=config.optimization.moe_grouped_gemm,
                  fix_router=config.optimization.fix_router, model_args=config.model)


def _configure_qwen3_next(model: nn.Module, config, device_type: str) -> None:
    from fsdp2_backend.models.qwen3_next.modeling import configure_qwen3_next
    from fsdp2_backend.kernels.gated_delta_rule import gdn_implementation

    o = config.optimization
    configure_qwen3_next(model, moe_grouped_gemm=o.moe_grouped_gemm, fix_router=o.fix_router,
                         gdn_chunk_size=o.gdn_chunk_size,
                         gdn_implementation=gdn_implementation(device_type, use_triton_gdn=o.use_triton_gdn,
                                                               use_flash_gdn=o.use_flash_gdn),
                         fused_gated_norm=o.use_triton_rmsnormgated, model_args=config.model)


def _configure_with_config(module: str, name: str) -> Callable:
    """A model's own `configure(model, config)`, which needs no device."""
    configure = _lazy(module, name)
    return lambda model, config, device_type: configure(model, config)


_SPECS: Mapping[str, ModelSpec] = MappingProxyType({
    "qwen3": ModelSpec(build=_build_qwen3),
    "qwen3_moe": _module_spec("qwen3_moe.modeling", "build_qwen3_moe", checkpoint_keys=_qwen3_moe_keys,
                              from_checkpoint=_qwen3_moe_param, configure=_configure_qwen3_moe),
    "qwen3_next": _module_spec("qwen3_next.modeling", "build_qwen3_next", checkpoint_keys=_qwen3_moe_keys,  # same expert keys
                               from_checkpoint=_qwen3_moe_param, configure=_configure_qwen3_next),
    "mamba3": ModelSpec(build=_lazy("mamba3.modeling", "build_mamba3"),
                        register_hf=_lazy("mamba3.modeling", "register_with_transformers")),
    # models/gpt_oss/modeling.py: sink attention, grouped experts, the project's router
    "gpt_oss": _module_spec("gpt_oss.modeling", "build_gpt_oss", configure=_configure_qwen3_moe,
                            from_checkpoint=_lazy("gpt_oss.modeling", "param_from_checkpoint", drop_config=True)),
    # models/minimax_m27/modeling.py: grouped experts, sigmoid router + checkpoint bias
    "minimax_m27": _module_spec("minimax_m27.modeling", "build_minimax_m2",
                                configure=_configure_with_config("minimax_m27.modeling", "configure_minimax")),
    # models/step35/modeling.py: transformers' Step-3.5 text model + lm head, grouped experts
    "step35": _module_spec("step35.modeling", "build_step35", configure=_configure_with_config("step35.modeling", "configure_step35")),
    # deepseek_v3 / mixtral / qwen2_moe: transformers' model with stacked experts and the project's router
    # (models/moe/family_swap.py; the family is the config's model_type)
    **{family: _module_spec("moe.family_swap", "build", configure=_configure_qwen3_moe)
       for family in ("deepseek_v3", "mixtral", "qwen2_moe")},
    **newer_specs(ModelSpec),  # deepseek_v4, glm52, longcat_flash_ngram (models/newer_ids.py)
})


def register_model_types() -> None:
    """Registers the HF config / model classes of the specs that have their own (`register_hf`) with transformers'
    Auto classes, so a saved directory of such a model type (e.g. "mamba3") loads."""
    for spec in _SPECS.values():
        if spec.register_hf is not None:
            spec.register_hf()


def registered_model_ids() -> tuple:
    """The model ids that have an implementation."""
    return tuple(_SPECS)


def model_spec(model_id: str) -> ModelSpec:
    """The spec for `model_id` (or another name of it, `MODEL_ID_ALIASES`); an unknown or not-yet-implemented id is
    a usage error."""
    model_id = MODEL_ID_ALIASES.get(model_id, (model_id,))[0]
    if model_id not in _SPECS:
        raise UsageError(f"model.model_id: '{model_id}' has no implementation in this project yet — use one of "
                         f"{', '.join(_SPECS)} or leave model_id unset to run the transformers model")
    return _SPECS[model_id]
