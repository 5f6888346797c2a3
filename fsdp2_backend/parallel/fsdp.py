"""FSDP2 (`fully_shard`) over the modules named by `fsdp_modules`, then the root.

- Each matched module becomes its own FSDP unit (one all-gather / reduce-scatter each), in model order; the
  root takes whatever is left (final norm, tied weights...).
- Modules whose parameters are also held by a module outside them (tied embeddings, matched or not) are not
  wrapped on their own: a parameter can belong to one unit only, so the root keeps it.
- `ignored_modules`: their parameters stay out of FSDP, whole on every rank. Their gradients are reduced over
  FSDP's mesh by the trainer (`parallel.replicated_grads`, SUM as FSDP's), recorded here; parameters another
  stage passes in `extra_ignored` (expert units, FSDP'd on their own mesh) are that stage's to reduce.
- Mixed precision from `param_dtype` / `reduce_dtype`; parameters stay fp32 (the optimizer's master copy).
- `shard_placement_fn` is a dotted import path `package.module.function`.
- The default `fsdp_modules` names Llama-style paths (`model.layers.{}`); a model whose decoder blocks live elsewhere
  (GPT-2's `transformer.h.N`) gets its blocks — transformers' `_no_split_modules` classes — as units instead, said
  once (`_family_default`), rather than one root unit holding every layer.
- The output layer (`get_output_embeddings()`, when it is a unit) is not resharded after forward: its backward
  follows at once, so resharding would only add an all-gather per micro-batch.
- Explicit prefetch: each unit all-gathers the next `num_to_forward_prefetch` units in forward and the
  previous `num_to_backward_prefetch` units in backward.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Callable, List, Optional, Sequence, Set

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdp2_backend.config import ParallelArguments
from fsdp2_backend.parallel.offload import offload_policy
from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.parallel.plans import lenient_matches, unmatched_patterns
from fsdp2_backend.parallel.replicated_grads import mark_replicated

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def import_dotted(path: str, field: str) -> Callable:
    """The object at `package.module.name`; a bad path is a usage error naming `field`."""
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"{field}: cannot import '{path}' ({exc}) — give a dotted path package.module.function "
                         f"importable on every rank")


def mixed_precision_policy(parallel: ParallelArguments) -> MixedPrecisionPolicy:
    """Compute in `param_dtype`, reduce gradients in `reduce_dtype`."""
    return MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[parallel.param_dtype],
                                reduce_dtype=TORCH_DTYPES[parallel.reduce_dtype])


def _ignored_params(model: nn.Module, patterns: Optional[Sequence[str]]) -> Set[nn.Parameter]:
    if not patterns:
        return set()
    return {p for _, module in lenient_matches(model, patterns, "parallel.ignored_modules", require_one=False)
            for p in module.parameters()}


def _family_default(model: nn.Module, patterns: Sequence[str]) -> Sequence[str]:
    """`patterns`, or, when they are the default and its layer pattern matches nothing here, the default's
    patterns that match plus the model's own decoder blocks (transformers' `_no_split_modules` classes)."""
    default = ParallelArguments().fsdp_modules
    if list(patterns) != default or not unmatched_patterns(model, default[:1]):
        return patterns
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = sorted({name.rsplit(".", 1)[0] + ".{}" for name, module in model.named_modules()
                     if type(module).__name__ in block_classes and name.rsplit(".", 1)[-1].isdigit()})
    if not blocks:
        return patterns
    from fsdp2_backend.distributed.console import print_rank0

    print_rank0(f"parallel.fsdp_modules: the default's '{default[0]}' is not a path of {type(model).__name__} — its "
                f"decoder blocks {', '.join(blocks)} are the FSDP units (set fsdp_modules to choose others)")
    unmatched = set(unmatched_patterns(model, default[1:]))
    return blocks + [p for p in default[1:] if p not in unmatched]


def _units(model: nn.Module, patterns: Sequence[str], ignored: Set[nn.Parameter]) -> List[nn.Module]:
    """The matched modules to wrap, in model order, without tied ones and ones with nothing to shard."""
    patterns = _family_default(model, patterns)
    # Lenient like the other plan fields: MindSpeed's YAMLs list modules some models lack (e.g. its mamba3 CI
    # YAML names `model.embeddings`); such a pattern is warned about once and the rest still shard.
    matched = lenient_matches(model, patterns, "parallel.fsdp_modules")
    holders = {}  # parameter -> the modules anywhere in the model that hold it directly
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(p, []).append(module)
    units = []
    for _, module in matched:
        params = [p for p in module.parameters() if p not in ignored]
        inside = set(map(id, module.modules()))
        # Also held by a module outside this one (GPT-2's lm_head shares wte's weight, and only wte is
        # matched): a tie, left to the root, which is the one unit that sees both uses.
        tied = any(id(holder) not in inside for p in params for holder in holders[p])
        if params and not tied:
            units.append(module)
    return units


def apply_fsdp(model: nn.Module, parallel: ParallelArguments, mesh: DeviceMesh,
               extra_ignored: Optional[Set[nn.Parameter]] = None) -> nn.Module:
    """Shards `model` in place per `parallel`'s FSDP fields; returns the root FSDP module."""
    replicated = _ignored_params(model, parallel.ignored_modules) - set(extra_ignored or ())
    ignored = replicated | set(extra_ignored or ())
    placement = (import_dotted(parallel.shard_placement_fn, "parallel.shard_placement_fn")
                 if parallel.shard_placement_fn else None)
    common = dict(mesh=mesh, mp_policy=mixed_precision_policy(parallel), shard_placement_fn=placement,
                  ignored_params=ignored or None)
    policy = offload_policy(parallel.cpu_offload, mesh.device_type)  # parallel/offload.py
    if policy is not None:
        common["offload_policy"] = policy
    units = _units(model, parallel.fsdp_modules, ignored)
    if parallel.tp_size > 1:
        # Under TP the embedding, the output layer and the root return views (the local tensor of the TP plan's
        # output DTensor), and FSDP2 warns once per unit and rank that an in-place op on such a view would skip
        # its pre-backward hook. Nothing modifies them in place (the first block adds its residual out of place,
        # the loss only reads the logits; TP2 trains as TP1 does: tests/parallel/test_tensor_parallel.py), so that
        # one warning is silenced.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                                category=UserWarning)
    # Innermost first: fully_shard on a parent after its children leaves the children's parameters to them.
    # The output layer runs last in forward and first in backward: resharding it after forward only to gather it
    # again at once costs one all-gather per micro-batch for no memory (torchtitan keeps its last unit likewise).
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in sorted(units, key=lambda m: -_depth(model, m)):
        reshard = parallel.reshard_after_forward and module is not output_layer
        fully_shard(module, reshard_after_forward=reshard, **common)
    # The root's parameters are needed again at once for backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **common)
    # in model order: every rank reduces them in the same order
    mark_replicated(model, [name for name, p in model.named_parameters() if p in replicated], mesh)
    _set_prefetch([m for m in units if isinstance(m, FSDPModule)], parallel.num_to_forward_prefetch,
                  parallel.num_to_backward_prefetch)
    return model


def _depth(root: nn.Module, target: nn.Module) -> int:
    for name, module in root.named_modules():
        if module is target:
            return name.count(".") + 1
    return 0


def _set_prefetch(units: List[FSDPModule], forward: int, backward: int) -> None:
    if forward > 0:
        for i, unit in enumerate(units[:-1]):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + forward])
    if backward > 0:
        for i in range(1, len(units)):
            units[i].set_modules_to_backward_prefetch(list(reversed(units[max(0, i - backward):i])))

