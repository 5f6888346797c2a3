"""Config rules of the optimizer variants: MindSpeed's O2 (`training.o2_optimizer`, training/o2_adamw.py) and
Muon's options (`training.muon_*`, training/muon.py). Torch-free; called once from `validation`.
"""
from __future__ import annotations

from typing import List


def optimizer_errors(config) -> List[str]:
    """Every problem of the optimizer-variant fields."""
    t, p = config.training, config.parallel
    errors: List[str] = []
    if t.o2_optimizer and p.param_dtype != "bf16":
        errors.append(f"training.o2_optimizer: MindSpeed's O2 optimizer supports bf16 training only (parallel."
                      f"param_dtype is {p.param_dtype}) — train with --bf16, or drop --o2-optimizer")
    return errors
