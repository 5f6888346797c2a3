"""MoE blocks under tensor parallel with expert parallel: Megatron's `--expert-tensor-parallel-size 1`.

Megatron carves the expert-parallel group out of the tp x dp (x cp) ranks when the experts are not
tensor-parallel (expert tensor-parallel size 1): attention and dense MLPs are tensor-parallel, while the MoE layer
runs on each rank's own tokens — its sequence-parallel shard — and the all-to-all moves them to the experts' ranks,
tp peers included. This engine does the same: `ParallelContext.ep_mesh` `(ep_replicate, ep, ep_fsdp)` spans all
ranks (tp fastest), so an ep group of size <= tp is made of tp peers, and an MoE block (the parent of an
expert-parallel experts module) becomes *token-local*:

- its input is this rank's sequence shard: with `sequence_parallel` the residual stream already is one; without
  it the replicated input is split along the sequence at the block's entry and the output all-gathered at its
  exit (DTensor redistributes: the backward gathers / slices, exact);
- the experts are sharded by the expert stage (not tensor-parallel): every rank dispatches different tokens;
- its other parameters (router, shared experts, their gate) stay whole on every tp rank as Replicate DTensors
  (one mesh with the rest for FSDP and the optimizer) and run on the local tokens with local weights whose
  gradient is marked Partial: FSDP2 sums it over the tp ranks (each saw different tokens) before reducing it.
- the routers' load-balancing token counts are summed over the tp x cp ranks (`router_groups`), as Megatron's
  tp_cp group does.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdp2_backend.parallel.plans import match_modules

_SEQ = Shard(1)


def token_local_blocks(model: nn.Module, expert_patterns: Sequence[str]) -> List[str]:
    """Names of the MoE blocks holding the experts `expert_patterns` select (their parents)."""
    return sorted({name.rsplit(".", 1)[0] for name, _ in match_modules(model, expert_patterns) if "." in name})


def inside(name: str, blocks: Sequence[str]) -> bool:
    """True when module `name` is one of `blocks` or below one."""
    return any(name == block or name.startswith(block + ".") for block in blocks)


def _split_sequence(x, mesh: DeviceMesh):
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [_SEQ]).to_local()


def _gather_sequence(out, mesh: DeviceMesh):
    if isinstance(out, tuple):
        return tuple(_gather_sequence(item, mesh) for item in out)
    if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
        return out
    return DTensor.from_local(out, mesh, [_SEQ], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _with_local_weights(module: nn.Module) -> None:
    """During `module`'s forward its own (Replicate DTensor) parameters are its local tensors, their gradient
    marked Partial (this rank's tokens only). Swapped in a pre-hook and restored (same order) in a post-hook, so
    FSDP2's unsharded parameters stay the registered ones."""
    names = [name for name, _ in module.named_parameters(recurse=False)]

    def before(mod, _args):
        for name in names:
            param = mod._parameters.pop(name)
            mod.__dict__["_tp_saved_" + name] = param
            mod.__dict__[name] = param.to_local(grad_placements=[Partial()]) if isinstance(param, DTensor) else param

    def after(mod, _args, _out):
        for name in names:
            del mod.__dict__[name]
            mod._parameters[name] = mod.__dict__.pop("_tp_saved_" + name)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def make_token_local(model: nn.Module, mesh: DeviceMesh, blocks: Sequence[str], experts: Sequence[str],
                     sequence_parallel: bool, memo: Dict[int, nn.Parameter]) -> None:
    """Makes each of `blocks` token-local on the tp `mesh` (see the module docstring); `experts` (globs) are left
    to the expert stage. `memo` keeps tied parameters one parameter."""
    from fsdp2_backend.parallel.plans import matches

    for block in blocks:
        module = model.get_submodule(block)
        if not sequence_parallel:
            module.register_forward_pre_hook(lambda _m, args: (_split_sequence(args[0], mesh),) + tuple(args[1:])
                                             if args else args)
            module.register_forward_hook(lambda _m, _args, out: _gather_sequence(out, mesh))
        for name, sub in module.named_modules(prefix=block):
            own = list(sub.named_parameters(recurse=False))
            if not own or matches(name, experts):
                continue
            for param_name, param in own:
                if id(param) not in memo:
                    memo[id(param)] = nn.Parameter(DTensor.from_local(param.data, mesh, [Replicate()], run_check=False),
                                                   requires_grad=param.requires_grad)
                setattr(sub, param_name, memo[id(param)])
            _with_local_weights(sub)
