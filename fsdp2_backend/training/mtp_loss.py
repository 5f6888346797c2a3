"""Multi-token prediction's share of the training step (`model.mtp_num_layers`; the model side is models/mtp.py).

Per micro-batch: the rolled ids, labels and masks of every depth, made on the whole sequence before any
context-parallel split (`rolled`), and the model's forward with the depths' loss attached to its logits
(`forward`: weighted mtp_loss_scaling_factor / D, normalised like the lm loss by the step's `GlobalBatchLoss`).
Logged per depth (Megatron's MTPLossLoggingHelper, `mtp_k loss`): each micro-batch's mean over its whole sequence
(sums and counts all-reduced over the cp group), averaged over micro-batches and data-parallel ranks after the
step (`finish`, the trainer's after-step hook on its `OptimizerStep`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from fsdp2_backend.models.mtp import mtp_batch, mtp_forward


class MTPLoss:
    """The MTP term of one run: `num_layers` depths weighted `scaling_factor` in total; `ctx` gives the groups."""

    def __init__(self, num_layers: int, scaling_factor: float, ctx):
        self.num_layers, self.scaling_factor, self.ctx = num_layers, scaling_factor, ctx
        self._means: Optional[torch.Tensor] = None

    def rolled(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The `mtp_*` keys of `batch` (the whole sequence)."""
        return {k: v for k, v in mtp_batch(batch, self.num_layers).items() if k.startswith("mtp_")}

    def forward(self, model, batch: Dict[str, torch.Tensor], accounting, loss_scale: float):
        """The model's output on `batch` (this rank's share, with the `rolled` keys), the MTP loss attached to its
        logits; the depths' means of this micro-batch are recorded."""
        weight = self.scaling_factor / self.num_layers
        out, sums, counts = mtp_forward(model, batch, self.num_layers,
                                        lambda s, c: accounting.extra_backward_loss(s, c, weight), loss_scale)
        totals = torch.stack([torch.stack(sums), torch.stack(counts)]).float()
        if self.ctx.cp_mesh.size() > 1:
            dist.all_reduce(totals, group=self.ctx.cp_mesh.get_group())
        means = totals[0] / totals[1].clamp(min=1)
        self._means = means if self._means is None else self._means + means
        return out

    def finish(self, micro_batches: int) -> Dict[str, float]:
        """{"mtp_k loss": the step's mean} averaged over micro-batches and data-parallel ranks, and resets."""
        if self._means is None:
            return {}
        means = self._means
        if self.ctx.loss_mesh.size() > 1:
            dist.all_reduce(means, group=self.ctx.loss_mesh.get_group())
        means = means / (micro_batches * self.ctx.loss_mesh.size())
        self._means = None
        return {f"mtp_{k + 1} loss": v for k, v in enumerate(means.tolist())}
