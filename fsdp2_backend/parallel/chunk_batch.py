"""MindSpeed's ChunkMBS (`parallel.enable_chunk_batch`): each module named by `chunk_mbs_modules` runs its forward
on slices of `chunk_mbs` samples, one after another, and returns the slices' outputs joined again.

Installed on the instance's `forward` (module names stay as they were), after recompute and before FSDP: FSDP's
hooks sit around the module call, so its parameters are all-gathered once for all the slices, in forward and in
backward — fewer all-gathers than gradient accumulation over the smaller micro-batches, less activation memory
than one large micro-batch (with recompute, each slice is recomputed on its own). The math is the same as the
whole micro-batch when the module treats samples independently (decoder layers do); Megatron's load-balancing
losses, which are computed per call, are therefore refused with it by config validation.

What is sliced: the positional arguments at `chunk_mbs_arg_indexs` and the keyword arguments named by
`chunk_mbs_kwarg_names`, when they are tensors (or tuples / lists / dicts of tensors, such as rotary (cos, sin)) whose
`chunk_mbs_batch_dim` has the batch's size; everything else (a broadcast position embedding of batch 1, None, a
cache: training runs without one) goes whole to every slice. The batch's size is that of the first sliced positional argument.
"""
from __future__ import annotations

import functools
from typing import Any, List, Sequence

import torch
from torch import nn

from fsdp2_backend.parallel.plans import lenient_matches


def _slice(value: Any, start: int, length: int, dim: int, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, length) if value.dim() > dim and value.shape[dim] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, start, length, dim, batch) for v in value)
    if isinstance(value, dict):  # e.g. DeepSeek-V4's {"main": (cos, sin), "compress": (cos, sin)}
        return {k: _slice(v, start, length, dim, batch) for k, v in value.items()}
    return value


def _join(outputs: List[Any], dim: int) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim)
    if isinstance(first, (tuple, list)):
        return type(first)(_join([out[i] for out in outputs], dim) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _join([out[k] for out in outputs], dim) for k in first}
    return first  # None, or an object every slice shares (a cache)


def _chunked(forward, chunk: int, dim: int, arg_indexes: Sequence[int], kwarg_names: Sequence[str], *args,
             **kwargs):
    sliced = [i for i in arg_indexes if i < len(args) and isinstance(args[i], torch.Tensor)]
    if not sliced or args[sliced[0]].dim() <= dim or args[sliced[0]].shape[dim] <= chunk:
        return forward(*args, **kwargs)
    batch = args[sliced[0]].shape[dim]
    outputs = []
    for start in range(0, batch, chunk):
        length = min(chunk, batch - start)
        part_args = [_slice(a, start, length, dim, batch) if i in sliced else a for i, a in enumerate(args)]
        part_kwargs = {k: _slice(v, start, length, dim, batch) if k in kwarg_names else v for k, v in kwargs.items()}
        outputs.append(forward(*part_args, **part_kwargs))
    return _join(outputs, dim)


def apply_chunk_batch(model: nn.Module, parallel) -> List[str]:
    """Installs ChunkMBS on every module matching `parallel.chunk_mbs_modules`; returns their names."""
    matched = lenient_matches(model, parallel.chunk_mbs_modules, "parallel.chunk_mbs_modules")
    for _, module in matched:
        module.forward = functools.partial(_chunked, module.forward, parallel.chunk_mbs, parallel.chunk_mbs_batch_dim,
                                           tuple(parallel.chunk_mbs_arg_indexs), tuple(parallel.chunk_mbs_kwarg_names))
    return [name for name, _ in matched]
