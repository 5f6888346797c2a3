"""Activation recomputation: the modules named by `recompute_modules` keep no activations in forward.

Each matched module's forward runs under non-reentrant `torch.utils.checkpoint`, installed on the instance so
module names (and so state-dict keys and later plans) stay exactly as they were — no wrapper module. Applied
before FSDP: FSDP's hooks sit around the module call, so the recomputed forward in backward sees the
all-gathered parameters.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp2_backend.parallel.plans import lenient_matches, unmatched_patterns

# Megatron's `shared_experts` recompute module: transformers names it `shared_expert` (Qwen2-MoE, Qwen3-Next) or
# `shared_experts` (DeepSeek-V3, GLM): a pattern naming the spelling the model lacks selects the one it has.
_SPELLINGS = {"shared_expert": "shared_experts", "shared_experts": "shared_expert"}


def _respelled(model: nn.Module, patterns: Sequence[str]) -> List[str]:
    out = []
    for pattern in patterns:
        head, dot, last = pattern.rpartition(".")
        if last in _SPELLINGS and unmatched_patterns(model, [pattern]):
            other = head + dot + _SPELLINGS[last]
            if not unmatched_patterns(model, [other]):
                pattern = other
        out.append(pattern)
    return out


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def wrap_recomputed(module: nn.Module, wrap: Callable[[Callable], Callable]) -> bool:
    """When `module`'s forward is recomputed (`apply_recompute`), wraps the function the checkpoint runs with
    `wrap` (e.g. `torch.compile`), the checkpoint staying outermost, and returns True; False otherwise."""
    forward = module.__dict__.get("forward")
    if not (isinstance(forward, functools.partial) and forward.func is _checkpointed):
        return False
    module.forward = functools.partial(_checkpointed, wrap(forward.args[0]))
    return True


def apply_recompute(model: nn.Module, patterns: Sequence[str]) -> List[str]:
    """Recomputes every module matching `patterns` in backward; returns the names of those modules."""
    # lenient (one warning per pattern that matches nothing) as the other plan fields MindSpeed's YAMLs share
    # across models: its DeepSeek-V4 YAML names MTP layers (`mtp.layers.{*}.layer`) a model without MTP lacks
    matched = lenient_matches(model, _respelled(model, patterns), "parallel.recompute_modules")
    for _, module in matched:
        module.forward = functools.partial(_checkpointed, module.forward)
    return [name for name, _ in matched]
