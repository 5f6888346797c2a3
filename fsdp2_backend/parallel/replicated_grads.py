"""The gradients no FSDP unit reduces: parameters of `parallel.ignored_modules`, replicated on every rank.

`apply_fsdp` leaves those parameters out of FSDP (whole on every rank) and records them here (`mark_replicated`)
with the mesh FSDP reduces over (`ctx.fsdp_mesh`: dp_shard x cp, HSDP adds dp_replicate) — without the
parameters another stage owns (expert parameters, FSDP'd on their own expert mesh: reducing those over the
data-parallel mesh too would count them twice, and across the EP group would mix different experts).

Each rank's backward leaves only its own tokens' gradient on such a parameter, so without a reduction the
replicas drift apart. `ReplicatedGrads.all_reduce`, which `mark_replicated` registers as a reduce hook of the
optimizer step (`training.optimizer_step`: after the last micro-batch's backward, before the gradients are
unscaled, clipped or stepped), does what FSDP does for a sharded parameter: a SUM over
the same ranks with no division (the loss carries the 1/(dp x cp): `parallel.apply.set_gradient_policy`), so
the gradient equals the one the parameter would have if it were sharded — and the global norm
(`training.grad_clip`, which counts a plain tensor once, as replicated) is the sharded parameter's as well.

One flattened all-reduce per mesh dimension per step, in a fixed order, on every rank: a parameter that got no
gradient on a rank (an unused branch) contributes zeros there, and one that got none on any rank keeps no
gradient (as FSDP leaves an unused sharded parameter's). Nothing is built when no parameter is ignored.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2_backend.distributed.dtensor import local_tensor
from fsdp2_backend.training.optimizer_step import step_hooks

_MARK = "_replicated_grad_params"  # on the FSDP root: (parameter names, mesh)


def mark_replicated(root: nn.Module, names: Sequence[str], mesh: DeviceMesh) -> None:
    """Records on `root` the parameters (names, in model order) FSDP leaves replicated and unreduced, and
    registers their reduction on `root`'s optimizer step (nothing to do when there are none or one rank)."""
    setattr(root, _MARK, (tuple(names), mesh))
    hooks = step_hooks(root).reduce
    hooks.pop("replicated_grads", None)
    if names and mesh.size() > 1:
        reducer: List[ReplicatedGrads] = []

        def reduce() -> None:
            if not reducer:  # resolved at the first step: building on the meta device replaces the Parameters
                reducer.append(ReplicatedGrads.of(root))
            reducer[0].all_reduce()

        hooks["replicated_grads"] = reduce


def replicated_param_names(model: nn.Module) -> List[str]:
    """The parameters `mark_replicated` recorded on `model` (none for a model `apply_fsdp` did not shard)."""
    marked = getattr(model, _MARK, None)
    return list(marked[0]) if marked else []


class ReplicatedGrads:
    """All-reduces (SUM) the gradients of the recorded parameters over FSDP's mesh. Build with `of(model)`."""

    def __init__(self, params: List[nn.Parameter], mesh: DeviceMesh):
        self.params = params
        self.groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]  # HSDP: replicate, then shard

    @classmethod
    def of(cls, model: nn.Module) -> Optional["ReplicatedGrads"]:
        """The reducer for `model`'s replicated parameters; None when there are none or one rank holds them all
        (the step then does nothing extra)."""
        marked = getattr(model, _MARK, None)
        if not marked or not marked[0] or marked[1].size() == 1:
            return None
        names, mesh = marked
        # Resolved by name once, here: building on the meta device replaces the Parameter objects afterwards.
        return cls([model.get_parameter(name) for name in names], mesh)

    @torch.no_grad()
    def all_reduce(self) -> None:
        locals_ = [local_tensor(p) for p in self.params]
        grads = [None if p.grad is None else local_tensor(p.grad) for p in self.params]
        device = locals_[0].device
        parts = [torch.zeros(t.numel(), dtype=torch.float32, device=device) if g is None
                 else g.reshape(-1).float() for t, g in zip(locals_, grads)]
        had = torch.tensor([g is not None for g in grads], dtype=torch.float32, device=device)  # ranks with one
        flat = torch.cat(parts + [had])
        for group in self.groups:
            dist.all_reduce(flat, group=group)
        # Only a rank that got no gradient somewhere needs to know whether any rank did (a host sync).
        anyone = flat[-len(grads):].tolist() if any(g is None for g in grads) else None
        offset = 0
        for i, (param, local, grad) in enumerate(zip(self.params, locals_, grads)):
            n = local.numel()
            reduced = flat[offset:offset + n].view_as(local)
            offset += n
            if grad is not None:
                grad.copy_(reduced)
            elif anyone[i] > 0:
                param.grad = torch.zeros_like(param)
                local_tensor(param.grad).copy_(reduced)
