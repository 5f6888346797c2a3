"""The one place where parallelism is applied to a model, in one fixed order:

    quantize → TP → EP → CP → recompute → FSDP

Each stage is one function in its own module and is skipped when its size is 1 (or its feature off).
Stages whose module has not landed yet decline sizes > 1 with a usage error.
"""
from __future__ import annotations

import importlib

from torch import nn

from fsdp2_backend.config import Config
from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.errors import UsageError
from fsdp2_backend.parallel.fsdp import apply_fsdp
from fsdp2_backend.parallel.recompute import apply_recompute

# stage → (module under fsdp2_backend.parallel, its function(model, config, ctx) -> set of params FSDP must
# ignore or None, the field that turns it on). TODO(lead): F fills tensor/context parallel, G expert parallel.
_STAGES = {
    "tensor parallelism": ("tensor_parallel", "apply_tensor_parallel", "parallel.tp_size"),
    "expert parallelism": ("expert_parallel", "apply_expert_parallel", "parallel.ep_size"),
    "context parallelism": ("context_parallel", "apply_context_parallel", "parallel.cp_size"),
}


def _stage(name: str):
    module_name, function, field = _STAGES[name]
    try:
        module = importlib.import_module(f"fsdp2_backend.parallel.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"fsdp2_backend.parallel.{module_name}":
            raise
        raise UsageError(f"{field}: {name} is not available in this version yet — use 1")
    return getattr(module, function)


def apply_parallelism(model: nn.Module, config: Config, ctx: ParallelContext) -> nn.Module:
    """Applies every configured parallel stage to `model` in the fixed order; returns the FSDP root."""
    parallel = config.parallel
    if config.model.quant_recipe_name:
        raise UsageError(f"model.quant_recipe_name: '{config.model.quant_recipe_name}' quantisation is not "
                         f"available in this version yet — leave it unset")
    fsdp_ignored = set()
    enabled = {"tensor parallelism": parallel.tp_size > 1,
               "expert parallelism": parallel.ep_size > 1 or parallel.ep_fsdp_size > 1,
               "context parallelism": parallel.cp_size > 1}
    for name in ("tensor parallelism", "expert parallelism", "context parallelism"):
        if enabled[name]:
            fsdp_ignored |= set(_stage(name)(model, config, ctx) or ())
    if parallel.recompute:
        apply_recompute(model, parallel.recompute_modules)
    return apply_fsdp(model, parallel, ctx.fsdp_mesh, extra_ignored=fsdp_ignored)
