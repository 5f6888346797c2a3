"""Expert parallelism (EP) and FSDP inside the expert group — the EP stage of `parallel.apply`.

Meshes (built by `ParallelContext`): `ep_mesh` is `(ep_replicate, ep, ep_fsdp)` over all ranks.
- EP (`shard_experts`): every module matched by `ep_modules` (a `GroupedExperts`) gets its stacked weights as
  DTensors `Shard(0)` on the `ep` mesh — whole experts per rank, global shape kept — and an all-to-all
  dispatcher (`moe_dispatch`) over the `ep` group.
- Expert FSDP (`apply_expert_fsdp`): every module matched by `ep_fsdp_modules` becomes its own FSDP unit on
  the `ep_fsdp` mesh (HSDP `(ep_replicate, ep_fsdp)` when the expert group does not span the world), its
  placement from `efsdp_shard_placement_fn` (default `shard_by_dim_1`: dim 0 is already split over experts).
  The resulting parameters are DTensors on the `(ep_fsdp, ep)` mesh with placements `(Shard(1), Shard(0))`
  (`(Replicate(), Shard(1), Shard(0))` under HSDP; `(Shard(1),)` on `ep_fsdp` alone when ep is 1), so DCP
  saves every expert under its global index and reshards EP 2 ↔ EP 1.
  With ep > 1 an expert-FSDP unit may hold expert weights only: anything else in it (a router) would be
  reduced over the expert group instead of all data-parallel ranks.

Gradient scale: an expert's gradient already sums the contributions of every rank of its `ep` group (the
all-to-all backward), and its FSDP group has only `world / ep` ranks, so FSDP's default average would be
`ep` times too large (the known bug class). The rule: expert units use the same TOTAL divisor as the
non-expert units: the one gradient policy (`parallel.apply.set_gradient_policy`, applied to every FSDP unit
once all exist: SUM, divide factor 1, the loss carrying 1/(dp x cp)) covers the expert units too.

Expert parameters then live on their own mesh: an optimizer may hold both kinds in one group, but a global
gradient norm must reduce each gradient over its own mesh (`training.grad_clip.total_grad_norm` does).
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Set, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.parallel.moe_dispatch import make_dispatcher
from fsdp2_backend.parallel.plans import lenient_matches, match_modules


def shard_by_dim_1(param: nn.Parameter) -> Shard:
    """Expert FSDP placement: shard dim 1 (dim 0 indexes experts, already split by EP)."""
    return Shard(1)


_NAMED_PLACEMENTS = {"shard_by_dim_1": shard_by_dim_1}


def resolve_shard_placement_fn(name: Optional[str]) -> Optional[Callable]:
    """`efsdp_shard_placement_fn`: a known name (`shard_by_dim_1`), a dotted import path, or None (dim 0)."""
    if not name:
        return None
    if name in _NAMED_PLACEMENTS:
        return _NAMED_PLACEMENTS[name]
    from fsdp2_backend.parallel.fsdp import import_dotted

    return import_dotted(name, "parallel.efsdp_shard_placement_fn")


def expert_modules(model: nn.Module, patterns: Iterable[str], field: str) -> List[Tuple[str, GroupedExperts]]:
    """The stacked-experts modules matched by `patterns`; anything else matched is a usage error."""
    matched = lenient_matches(model, list(patterns), field)
    wrong = [f"{name} ({type(module).__name__})" for name, module in matched if not isinstance(module, GroupedExperts)]
    if wrong:
        raise UsageError(f"{field}: matches modules that are not stacked MoE experts: {', '.join(wrong[:3])} — "
                         f"point it at the experts of an MoE model (model.layers.{{*}}.mlp.experts) and use a "
                         f"model id with stacked experts (model_id qwen3_moe)")
    return matched


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, patterns: Iterable[str], dispatcher: Callable,
                  field: str = "parallel.ep_modules") -> List[GroupedExperts]:
    """EP: shards each matched module's experts over the 1-D `ep_mesh` and installs `dispatcher`."""
    ep = ep_mesh.size()
    modules = expert_modules(model, patterns, field)
    for name, module in modules:
        if module.num_experts % ep:
            raise UsageError(f"parallel.ep_size: {ep} does not divide the {module.num_experts} experts of {name} — "
                             f"use a divisor of {module.num_experts}")
        for param_name, param in list(module.named_parameters(recurse=False)):
            # Every rank holds the same full weights (same seed or checkpoint): slice locally, no scatter.
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.dispatcher = dispatcher
    return [module for _, module in modules]


def apply_expert_fsdp(model: nn.Module, mesh: DeviceMesh, patterns: Iterable[str], *,
                      shard_placement_fn: Optional[Callable] = shard_by_dim_1,
                      mp_policy: Optional[MixedPrecisionPolicy] = None, reshard_after_forward: bool = True,
                      field: str = "parallel.ep_fsdp_modules") -> List[FSDPModule]:
    """FSDP units on the expert-FSDP `mesh` (1-D, or 2-D HSDP) for the modules matched by `patterns`.

    Call before the non-expert `fully_shard`s, which then leave these parameters to these units; their
    gradient reduction is set with every other unit's (`parallel.apply.set_gradient_policy`).
    """
    units = []
    # lenient like ep_modules: MindSpeed's DeepSeek-V4 YAML also names MTP experts a model without MTP lacks
    for _, module in lenient_matches(model, list(patterns), field):
        fully_shard(module, mesh=mesh, shard_placement_fn=shard_placement_fn,
                    reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
        units.append(module)
    return units


def expert_fsdp_mesh(ep_mesh: DeviceMesh) -> DeviceMesh:
    """The expert-FSDP mesh of a `(ep_replicate, ep, ep_fsdp)` mesh: `ep_fsdp`, or HSDP with `ep_replicate`."""
    if ep_mesh["ep_replicate"].size() == 1:
        return ep_mesh["ep_fsdp"]
    return ep_mesh["ep_replicate", "ep_fsdp"]


def expert_parallel_problems(model: nn.Module, parallel) -> List[str]:
    """Every reason the EP stage cannot run on `model` with `parallel`'s fields: modules `ep_modules` selects that
    are not stacked experts, an ep size that does not divide an expert count, expert-FSDP units holding
    non-expert parameters or leaving experts uncovered (ep > 1). The build's model check
    (`parallel.model_checks`) reports them with the other stages' before any stage runs."""
    matched = match_modules(model, list(parallel.ep_modules))
    if not matched:
        return [f"parallel.ep_modules: pattern '{p}' matches no module of {type(model).__name__} — use module "
                f"paths such as 'model.layers.{{*}}' or '*.q_proj'" for p in parallel.ep_modules]
    wrong = [f"{name} ({type(module).__name__})" for name, module in matched if not isinstance(module, GroupedExperts)]
    if wrong:
        return [f"parallel.ep_modules: matches modules that are not stacked MoE experts: {', '.join(wrong[:3])} — "
                f"point it at the experts of an MoE model (model.layers.{{*}}.mlp.experts) and use a model id with "
                f"stacked experts (model_id qwen3_moe)"]
    ep, problems = parallel.ep_size, []
    if ep <= 1:
        return problems
    problems += [f"parallel.ep_size: {ep} does not divide the {module.num_experts} experts of {name} — use a "
                 f"divisor of {module.num_experts}" for name, module in matched if module.num_experts % ep][:1]
    expert_params = {p for _, module in matched for p in module.parameters()}
    units = match_modules(model, list(parallel.ep_fsdp_modules))
    mixed = [name for name, module in units if any(p not in expert_params for p in module.parameters())]
    if mixed:
        problems.append(f"parallel.ep_fsdp_modules: {', '.join(mixed[:3])} hold non-expert parameters, which must "
                        f"be reduced over all data-parallel ranks — name the experts modules only "
                        f"(model.layers.{{*}}.mlp.experts)")
    covered = {p for _, unit in units for p in unit.parameters()}
    uncovered = [name for name, module in matched if any(p not in covered for p in module.parameters())]
    if uncovered:
        problems.append(f"parallel.ep_fsdp_modules: does not cover the expert modules {', '.join(uncovered[:3])} "
                        f"— their gradients would never be reduced; include them (or a module containing them)")
    return problems


def apply_expert_parallel(model: nn.Module, config, ctx) -> Set[nn.Parameter]:
    """The EP stage: EP over `ep_modules`, expert FSDP over `ep_fsdp_modules`; returns the expert parameters,
    which the non-expert FSDP must ignore."""
    from fsdp2_backend.parallel.fsdp import mixed_precision_policy

    parallel = config.parallel
    problems = expert_parallel_problems(model, parallel)  # a run's model check reported them already
    if problems:
        raise UsageError(problems)
    if parallel.ep_size > 1:
        group = ctx.ep_mesh["ep"].get_group()
        shard_experts(model, ctx.ep_mesh["ep"], parallel.ep_modules,
                      make_dispatcher(parallel.ep_dispatcher, group, ctx.device.type))
    units = apply_expert_fsdp(model, expert_fsdp_mesh(ctx.ep_mesh), parallel.ep_fsdp_modules,
                              shard_placement_fn=resolve_shard_placement_fn(parallel.efsdp_shard_placement_fn),
                              mp_policy=mixed_precision_policy(parallel),
                              reshard_after_forward=parallel.reshard_after_forward)
    covered = {p for unit in units for p in unit.parameters()}
    return covered

