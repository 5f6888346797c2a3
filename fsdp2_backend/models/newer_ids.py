"""The specs of the model ids MindSpeed-LLM added after the seed's reference (c77308a1): `deepseek_v4`
(models/deepseek_v4/modeling.py), `glm52` (transformers' glm_moe_dsa through models/moe/family_swap.py) and
`longcat_flash_ngram` (models/longcat_flash_ngram/modeling.py). Imports no torch: each function imports its module on first use.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict


def _call(module: str, name: str) -> Callable:
    def call(*args):
        return getattr(importlib.import_module(f"fsdp2_backend.models.{module}"), name)(*args)
    return call


def _configure(module: str, name: str) -> Callable:
    function = _call(module, name)
    return lambda model, config, *device_type: function(model, config)  # (model, config[, device type])


def _spec(spec_class, module: str, build: str, configure: Callable, **extra):
    return spec_class(build=_call(module, build), checkpoint_keys=_call(module, "checkpoint_keys"),
                      from_checkpoint=_call(module, "param_from_checkpoint"), configure=configure, **extra)


def _configure_family(model, config, *device_type) -> None:
    from fsdp2_backend.models.qwen3_moe.modeling import configure_moe

    configure_moe(model, moe_grouped_gemm=config.optimization.moe_grouped_gemm,
                  fix_router=config.optimization.fix_router, model_args=config.model)
    if config.training.indexer_loss_coeff:  # glm52: MindSpeed's DSA indexer KL loss (training only)
        from fsdp2_backend.models.dsa_indexer_loss import install_glm52

        install_glm52(model, config.training.indexer_loss_coeff)


def newer_specs(spec_class) -> Dict[str, object]:
    """{model id: spec} (`spec_class`: the registry's ModelSpec)."""
    return {
        "deepseek_v4": _spec(spec_class, "deepseek_v4.modeling", "build_deepseek_v4",
                             _configure("deepseek_v4.modeling", "configure_deepseek_v4")),
        "glm52": _spec(spec_class, "moe.family_swap", "build", _configure_family),
        "longcat_flash_ngram": _spec(spec_class, "longcat_flash_ngram.modeling", "build_longcat_ngram",
                                     _configure("longcat_flash_ngram.modeling", "configure_longcat"),
                                     register_hf=_call("longcat_flash_ngram.modeling", "register_with_transformers"),
                                     stored_layout=_call("longcat_flash_ngram.modeling", "stored_layout")),  # merged experts
    }
