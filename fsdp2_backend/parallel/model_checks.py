"""The second validation phase: the built model checked against the run's parallel layout, once, before any
parallel stage changes it.

The first phase (`fsdp2_backend.config.validation`) checks the config alone, before any process group. Some
facts exist only once the model is built: which modules a plan glob selects, a layer's feature count, the layer
types and attention modules a model has, its expert count. `built_model_problems` asks each stage that depends on
them (tensor parallel, expert parallel, context parallel over attention and linear attention) for every reason
it cannot run, so one error lists them all; the stages then re-check with the same functions only for direct
callers (a run never reaches their error). What depends on a batch (sequence length under sequence parallel,
packed documents under context parallel) is checked where the batch is.
"""
from __future__ import annotations

from typing import List

from torch import nn

from fsdp2_backend.usage_errors import UsageError


def built_model_problems(model: nn.Module, config) -> List[str]:
    """Every reason `parallel.apply`'s stages cannot run on `model` (after its own switches, before tensor
    parallel) with `config`'s layout; empty when they can."""
    parallel = config.parallel
    problems: List[str] = []
    expert_layout = parallel.ep_size > 1 or parallel.ep_fsdp_size > 1
    if parallel.tp_size > 1:
        from fsdp2_backend.parallel.moe_tensor_parallel import token_local_blocks
        from fsdp2_backend.parallel.tensor_parallel import tensor_parallel_plan

        experts = parallel.ep_modules if expert_layout else ()
        problems += tensor_parallel_plan(model, parallel.tp_size, parallel.tp_colwise, parallel.tp_rowwise,
                                         parallel.sequence_parallel, experts, token_local_blocks(model, experts))[2]
    if expert_layout:
        from fsdp2_backend.parallel.expert_parallel import expert_parallel_problems

        problems += expert_parallel_problems(model, parallel)
    if parallel.cp_size > 1:
        from fsdp2_backend.parallel.context_parallel.attention import attention_context_parallel_problems
        from fsdp2_backend.parallel.context_parallel.dsa import dsa_context_parallel
        from fsdp2_backend.parallel.context_parallel.linear_attention import (linear_attention_layers,
                                                                              linear_attention_problems)

        if not dsa_context_parallel(model):  # DSA models (deepseek_v4, glm52) check their own CP hook
            linear = linear_attention_layers(model)
            problems += linear_attention_problems(model, parallel.cp_size)
            problems += attention_context_parallel_problems(
                model, parallel.cp_size, parallel.cp_type, tp_size=parallel.tp_size,
                handled_layer_types=("linear_attention",) if linear else ())
    return problems


def check_built_model(model: nn.Module, config) -> nn.Module:
    """`model`, or a UsageError listing every `built_model_problems`."""
    problems = built_model_problems(model, config)
    if problems:
        raise UsageError(problems)
    return model
