"""Model ids → how to build, load and configure this project's own model implementations.

`model.model_id` unset runs the native transformers causal LM of the HF directory; a model id runs the
`ModelSpec` registered here. A spec's `build(hf_config)` returns an `nn.Module` causal LM with HF's
`_init_weights(module)` (seeded initialisation). Its parameters are named like the HF checkpoint's keys
unless the spec says otherwise: `checkpoint_keys(name, hf_config)` lists the keys holding a parameter and
`from_checkpoint(name, tensors, hf_config)` assembles it (e.g. per-expert tensors → stacked experts).
`configure(model, config)` applies the run's switches (e.g. MoE kernels). Later issues add a model by adding
one entry to `_SPECS`. Importing this module does not import torch (config validation lists the ids).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional

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
    configure: Optional[Callable[["nn.Module", object], None]] = None
    # registers the model's own config class with transformers' AutoConfig before a config.json is read
    register_hf: Optional[Callable[[], None]] = None


def _build_qwen3(hf_config) -> nn.Module:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(hf_config)


def _build_qwen3_moe(hf_config) -> nn.Module:
    from fsdp2_backend.models.qwen3_moe import build_qwen3_moe

    return build_qwen3_moe(hf_config)


def _qwen3_moe_keys(name: str, hf_config) -> List[str]:
    from fsdp2_backend.models.qwen3_moe import checkpoint_keys

    return checkpoint_keys(name, hf_config.num_experts)


def _qwen3_moe_param(name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    from fsdp2_backend.models.qwen3_moe import param_from_checkpoint

    return param_from_checkpoint(name, tensors, hf_config.num_experts)


def _configure_qwen3_moe(model: nn.Module, config) -> None:
    from fsdp2_backend.models.qwen3_moe import configure_moe

    configure_moe(model, moe_grouped_gemm=config.optimization.moe_grouped_gemm,
                  fix_router=config.optimization.fix_router, model_args=config.model)


def _build_qwen3_next(hf_config) -> nn.Module:
    from fsdp2_backend.models.qwen3_next import build_qwen3_next

    return build_qwen3_next(hf_config)


def _configure_qwen3_next(model: nn.Module, config) -> None:
    from fsdp2_backend.distributed.device import detect_device_type
    from fsdp2_backend.models.qwen3_next import configure_qwen3_next
    from fsdp2_backend.kernels.gated_delta_rule import gdn_implementation

    o = config.optimization
    configure_qwen3_next(model, moe_grouped_gemm=o.moe_grouped_gemm, fix_router=o.fix_router,
                         gdn_chunk_size=o.gdn_chunk_size,
                         gdn_implementation=gdn_implementation(detect_device_type(), use_triton_gdn=o.use_triton_gdn,
                                                               use_flash_gdn=o.use_flash_gdn),
                         fused_gated_norm=o.use_triton_rmsnormgated, model_args=config.model)


def _build_mamba3(hf_config) -> nn.Module:
    from fsdp2_backend.models.mamba3 import build_mamba3

    return build_mamba3(hf_config)


def _register_mamba3() -> None:
    from fsdp2_backend.models.mamba3 import register_with_transformers

    register_with_transformers()


def _gpt_oss_spec() -> ModelSpec:
    def build(hf_config):
        from fsdp2_backend.models.gpt_oss import build_gpt_oss
        return build_gpt_oss(hf_config)

    def keys(name, hf_config):
        from fsdp2_backend.models.gpt_oss import checkpoint_keys
        return checkpoint_keys(name, hf_config)

    def param(name, tensors, hf_config):
        from fsdp2_backend.models.gpt_oss import param_from_checkpoint
        return param_from_checkpoint(name, tensors)

    return ModelSpec(build=build, checkpoint_keys=keys, from_checkpoint=param, configure=_configure_qwen3_moe)


def _minimax_m2_spec() -> ModelSpec:
    def build(hf_config):
        from fsdp2_backend.models.minimax_m2 import build_minimax_m2
        return build_minimax_m2(hf_config)

    def keys(name, hf_config):
        from fsdp2_backend.models.minimax_m2 import checkpoint_keys
        return checkpoint_keys(name, hf_config)

    def param(name, tensors, hf_config):
        from fsdp2_backend.models.minimax_m2 import param_from_checkpoint
        return param_from_checkpoint(name, tensors, hf_config)

    def configure(model, config):
        from fsdp2_backend.models.minimax_m2 import configure_minimax
        configure_minimax(model, config)

    return ModelSpec(build=build, checkpoint_keys=keys, from_checkpoint=param, configure=configure)


def _moe_family_spec() -> ModelSpec:
    """deepseek_v3 / mixtral / qwen2_moe: transformers' model with stacked experts and the project's router
    (models/moe/family_swap.py; the family is the config's model_type)."""
    def build(hf_config):
        from fsdp2_backend.models.moe.family_swap import build as build_family
        return build_family(hf_config)

    def keys(name, hf_config):
        from fsdp2_backend.models.moe.family_swap import checkpoint_keys
        return checkpoint_keys(name, hf_config)

    def param(name, tensors, hf_config):
        from fsdp2_backend.models.moe.family_swap import param_from_checkpoint
        return param_from_checkpoint(name, tensors, hf_config)

    return ModelSpec(build=build, checkpoint_keys=keys, from_checkpoint=param, configure=_configure_qwen3_moe)


def _step35_spec() -> ModelSpec:
    def module():
        from fsdp2_backend.models import step35
        return step35

    return ModelSpec(build=lambda c: module().build_step35(c),
                     checkpoint_keys=lambda n, c: module().checkpoint_keys(n, c),
                     from_checkpoint=lambda n, t, c: module().param_from_checkpoint(n, t, c),
                     configure=lambda m, c: module().configure_step35(m, c))


_SPECS: Mapping[str, ModelSpec] = MappingProxyType({
    "qwen3": ModelSpec(build=_build_qwen3),
    "qwen3_moe": ModelSpec(build=_build_qwen3_moe, checkpoint_keys=_qwen3_moe_keys,
                           from_checkpoint=_qwen3_moe_param, configure=_configure_qwen3_moe),
    "qwen3_next": ModelSpec(build=_build_qwen3_next, checkpoint_keys=_qwen3_moe_keys,  # same per-expert keys
                            from_checkpoint=_qwen3_moe_param, configure=_configure_qwen3_next),
    "mamba3": ModelSpec(build=_build_mamba3, register_hf=_register_mamba3),
    "gpt_oss": _gpt_oss_spec(),  # models/gpt_oss.py: sink attention, grouped experts, the project's router
    "minimax_m27": _minimax_m2_spec(),  # models/minimax_m2.py: grouped experts, sigmoid router + checkpoint bias
    "step35": _step35_spec(),  # models/step35.py: transformers' Step-3.5 text model + lm head, grouped experts
    **{family: _moe_family_spec() for family in ("deepseek_v3", "mixtral", "qwen2_moe")},  # models/moe/family_swap.py
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
    """The spec for `model_id`; an unknown or not-yet-implemented id is a usage error."""
    if model_id not in _SPECS:
        raise UsageError(f"model.model_id: '{model_id}' has no implementation in this project yet — use one of "
                         f"{', '.join(_SPECS)} or leave model_id unset to run the transformers model")
    return _SPECS[model_id]
