"""transformers' NemotronH (`model_type nemotron_h`, Megatron's hybrid Mamba stack) made to honour its config's
Mamba step-size limit.

Why this exists: transformers 5.x's `NemotronHMamba2Mixer` clamps the step size dt = softplus(. + dt_bias) to
`(config.time_step_min, inf)`, ignoring the config's own `time_step_limit` field, which NemotronH configs carry
(default (0, inf)). megatron-core's `MambaMixer` (and NVIDIA's original NemotronH code) use the limit (0, inf) —
no clamp — while `time_step_min` (0.001) only sets the range dt_bias is initialised in. A model built from
Megatron's hybrid flags (`megatron_compat/architecture/hybrid.py`) therefore gets each mixer's `time_step_limit`
set from the config, the one attribute the mixer reads it from (its fused-kernel and torch paths both do).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn


def honour_time_step_limit(model: nn.Module, log: Optional[Callable[[str], None]] = None) -> nn.Module:
    """Sets every NemotronH Mamba mixer's dt limit to its config's `time_step_limit`; returns `model`."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "nemotron_h" or getattr(config, "time_step_limit", None) is None:
        return model
    limit = tuple(float(v) for v in config.time_step_limit)
    changed = 0
    for module in model.modules():
        if type(module).__name__ == "NemotronHMamba2Mixer" and tuple(module.time_step_limit) != limit:
            module.time_step_limit = limit
            changed += 1
    if changed:
        if log is None:
            from fsdp2_backend.distributed.console import print_rank0 as log
        log(f"nemotron_h: the Mamba step size dt is limited to {limit} (the config's time_step_limit, as "
            f"megatron-core's MambaMixer) in {changed} layers")
    return model
