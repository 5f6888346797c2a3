"""The one place where parallelism is applied to a model, in one fixed order:

    quantize → TP → EP → CP → recompute → FSDP

Each stage is one function in its own module (`tensor_parallel`, `expert_parallel`, `context_parallel`,
`recompute`, `fsdp`), skipped when its size is 1 or its feature off. A stage returns the parameters it
reduces itself (expert units), which FSDP must then ignore.
"""
from __future__ import annotations

from typing import Set

from torch import nn

from fsdp2_backend.config import Config
from fsdp2_backend.distributed.context import ParallelContext
from usage_errors import UsageError
from fsdp2_backend.parallel.fsdp import apply_fsdp
from fsdp2_backend.parallel.recompute import apply_recompute


def _tensor_parallel(model: nn.Module, config: Config, ctx: ParallelContext) -> Set[nn.Parameter]:
    from fsdp2_backend.parallel.tensor_parallel import apply_tensor_parallel

    parallel = config.parallel
    experts = parallel.ep_modules if parallel.ep_size > 1 or parallel.ep_fsdp_size > 1 else ()
    apply_tensor_parallel(model, ctx.tp_mesh, colwise=parallel.tp_colwise, rowwise=parallel.tp_rowwise,
                          sequence_parallel=parallel.sequence_parallel, exclude=experts)
    return set()  # TP parameters are DTensors on the tp mesh; FSDP shards them further over its own mesh


def _expert_parallel(model: nn.Module, config: Config, ctx: ParallelContext) -> Set[nn.Parameter]:
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel

    return apply_expert_parallel(model, config, ctx)  # expert units are FSDP'd on their own mesh


def _context_parallel(model: nn.Module, config: Config, ctx: ParallelContext) -> Set[nn.Parameter]:
    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel

    enable_context_parallel(model, ctx.cp_mesh, config.parallel.cp_type, tp_size=config.parallel.tp_size)
    return set()


def apply_parallelism(model: nn.Module, config: Config, ctx: ParallelContext) -> nn.Module:
    """Applies every configured parallel stage to `model` in the fixed order; returns the FSDP root."""
    parallel = config.parallel
    if config.model.quant_recipe_name:
        raise UsageError(f"model.quant_recipe_name: '{config.model.quant_recipe_name}' quantisation is not "
                         f"available in this version yet — leave it unset")
    fsdp_ignored: Set[nn.Parameter] = set()
    if parallel.tp_size > 1:
        fsdp_ignored |= _tensor_parallel(model, config, ctx)
    if parallel.ep_size > 1 or parallel.ep_fsdp_size > 1:
        fsdp_ignored |= _expert_parallel(model, config, ctx)
    if parallel.cp_size > 1:
        fsdp_ignored |= _context_parallel(model, config, ctx)
    if parallel.recompute:
        apply_recompute(model, parallel.recompute_modules)
    return apply_fsdp(model, parallel, ctx.fsdp_mesh, extra_ignored=fsdp_ignored)
