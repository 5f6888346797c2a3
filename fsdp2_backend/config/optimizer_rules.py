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
    megatron_only = {"muon_nesterov": False, "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
                     "muon_extra_scale_factor": 1.0, "muon_fp32_matmul_prec": "medium"}
    if t.muon_scale_mode is None:
        errors += [f"training.{name}: an option of Megatron's Muon, which muon_scale_mode selects (unset: torch.optim."
                   f"Muon) — set training.muon_scale_mode (e.g. spectral), or drop {name}"
                   for name, default in megatron_only.items() if getattr(t, name) != default]
    if t.muon_num_ns_steps < 1:
        errors.append(f"training.muon_num_ns_steps: must be at least 1, got {t.muon_num_ns_steps}")
    return errors
