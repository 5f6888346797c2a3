"""Megatron's Muon (`--optimizer muon` with its `--muon-*` options; native `training.muon_scale_mode` and the other
`training.muon_*` fields): `MegatronMuon`, `newton_schulz`, `muon_scale_factor`.

Semantics of megatron-core 0.16.1 (`megatron/core/optimizer/muon.py`, `TensorParallelMuon`), whose maths lives in
NVIDIA's emerging-optimizers (`OrthogonalizedOptimizer`, `newton_schulz`, `get_muon_scale_factor`), which megatron-core
needs and this project does not install:
- which parameters: every trainable 2-D weight except the input embedding and the output layer (optimizer.py's
  `muon_param_names`); the rest (norms, biases, embeddings, 3-D expert stacks) go to AdamW (`--muon-scalar-optimizer
  adam`). HF models keep q/k/v as separate matrices, which is Megatron's default `--muon-split-qkv` (the fused QKV
  orthogonalised per q, k and v part).
- a step, per matrix: decoupled weight decay p <- p (1 - lr wd); momentum m <- beta m + (1 - beta) g; the update is
  m, or g + beta (m - g) with `--muon-nesterov`; Newton-Schulz orthogonalisation of the update in fp32 (transposed
  when it has more rows than columns, normalised by its Frobenius norm, then X <- a X + (b A + c A^2) X with
  A = X X^T for each (a, b, c) of the coefficient schedule: `--muon-coefficient-type` quintic (the 5 tuples of
  modded-nanogpt, cycled), simple (one tuple), polar_express (repeating its last); `--muon-num-ns-steps` steps;
  `--muon-fp32-matmul-prec medium` runs the iterations in bf16, high in fp32); times the scale factor of
  `--muon-scale-mode` (spectral sqrt(max(rows, cols)), unit_rms_norm sqrt(rows / cols), shape_scaling
  sqrt(max(1, rows / cols))) and `--muon-extra-scale-factor`; p <- p - lr x that.
Why not torch.optim.Muon: it takes one coefficient tuple for every iteration (no quintic schedule), has no
scale modes (its lr adjustments are "original" = shape_scaling and Moonshot's 0.2 sqrt(max) rms matching), and
computes in the gradient's dtype. torch.optim.Muon stays the native default (`muon_scale_mode` unset, ShardedMuon in
optimizer.py). FSDP2 shards the matrices: each update is gathered whole (`DTensor.full_tensor`), orthogonalised
identically on every rank (Megatron's `--muon-tp-mode duplicated`; `distributed` computes the same matrix) and
the local shard kept, so every layout steps as one rank does.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from fsdp2_backend.training.param_steps import momentum_update, on_full_matrix, params_with_grad, run_closure

# Newton-Schulz (a, b, c) schedules, as emerging-optimizers lists them (values from their cited sources).
COEFFICIENTS: Dict[str, List[Tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
}
_REPEAT_LAST = ("polar_express",)  # the others cycle through their schedule
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("medium", "high")


def coefficient_schedule(coefficient_type: str, steps: int) -> List[Tuple[float, float, float]]:
    sets = COEFFICIENTS[coefficient_type]
    if coefficient_type in _REPEAT_LAST:
        return [sets[min(k, len(sets) - 1)] for k in range(steps)]
    return [sets[k % len(sets)] for k in range(steps)]


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", matmul_precision: str = "medium",
                  eps: float = 1e-15) -> torch.Tensor:
    """The orthogonalisation of the 2-D fp32 matrix `x` (see the module docstring), returned in fp32."""
    transpose = x.size(0) > x.size(1)
    X = x.mT if transpose else x
    X = torch.nn.functional.normalize(X.float(), p=2, dim=(-2, -1), eps=eps)
    if matmul_precision == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    X = X.float()
    return X.mT if transpose else X


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r} — use one of {', '.join(SCALE_MODES)}")


class MegatronMuon(torch.optim.Optimizer):
    """Megatron's Muon over 2-D parameters (plain tensors or FSDP2 DTensors)."""

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = False,
                 weight_decay: float = 0.01, num_ns_steps: int = 5, coefficient_type: str = "quintic",
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, matmul_precision: str = "medium"):
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        num_ns_steps=num_ns_steps, coefficient_type=coefficient_type, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, matmul_precision=matmul_precision)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group, p, state in params_with_grad(self):
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            update = momentum_update(p, state, group["momentum"], group["nesterov"])
            p.add_(on_full_matrix(update, lambda matrix: _scaled_newton_schulz(matrix, group)).to(p.dtype), alpha=-lr)
        return loss


def _scaled_newton_schulz(matrix: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
    """The orthogonalised update of one whole matrix, times the scale mode's factor and the extra scale."""
    out = newton_schulz(matrix.float(), group["num_ns_steps"], group["coefficient_type"], group["matmul_precision"])
    return out * (muon_scale_factor(*matrix.shape, group["scale_mode"]) * group["extra_scale_factor"])


def megatron_muon_options(training) -> Dict[str, Any] | None:
    """MegatronMuon's keyword arguments from TrainingArguments (None: torch.optim.Muon, `muon_scale_mode` unset)."""
    if training.optimizer != "muon" or training.muon_scale_mode is None:
        return None
    return dict(nesterov=training.muon_nesterov, num_ns_steps=training.muon_num_ns_steps,
                coefficient_type=training.muon_coefficient_type, scale_mode=training.muon_scale_mode,
                extra_scale_factor=training.muon_extra_scale_factor, matmul_precision=training.muon_fp32_matmul_prec)
