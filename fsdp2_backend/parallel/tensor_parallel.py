"""Tensor parallel for HF decoder models: DTensor `parallelize_module` driven by the seed's glob plans.

- Modules matching `colwise` globs (q/k/v, gate/up) are ColwiseParallel, `rowwise` (o, down) RowwiseParallel, so
  each attention layer computes its local heads only (HF reshapes projections with `view(..., -1, head_dim)`,
  so it follows the local size by itself).
- Every other parameter (embedding, norms, lm_head) becomes a *Replicate* DTensor on the tp mesh, with hooks that
  turn its module's inputs into DTensors and outputs back into plain tensors. Why replicate rather than leave them
  plain: optimizers' foreach paths, gradient clipping and FSDP2 over a 2-D mesh need all parameters on one mesh.
  Embedding and lm_head are replicated (not vocab-parallel): exact, works with tied embeddings and any loss code,
  and FSDP still shards them over dp; the price is vocab x hidden per tp rank and a full-vocab logits tensor.
- q_norm/k_norm see head-sharded activations, so their input is marked Shard(heads); their weight gradient is then
  a partial sum, all-reduced by a gradient hook (FSDP2 does the same itself when it wraps the parameter).
- `sequence_parallel=True` (Megatron `--sequence-parallel`): the residual stream between blocks is split along the
  sequence on the tp ranks; norms run on their shard (input Shard(1)), attention/MLP inputs are all-gathered, o/down
  outputs reduce-scattered, the embedding output scattered and the lm_head input gathered. Same results, less
  activation memory.
- Module selection uses the plan globs of `parallel.plans` (as FSDP / EP / recompute do): `*.q_proj` and
  `model.layers.{*}.self_attn.q_proj` select the same modules.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.distributed.dtensor import local_tensor
from fsdp2_backend.parallel.moe_tensor_parallel import inside, make_token_local
from fsdp2_backend.parallel.plans import match_modules, matches
from fsdp2_backend.config.tp_cp_checks import tensor_parallel_problems

DEFAULT_COLWISE = ("*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj")
DEFAULT_ROWWISE = ("*.o_proj", "*.down_proj")
# Norms applied per head after the (column-parallel) q/k projections.
HEAD_NORM_GLOBS = ("*.q_norm", "*.k_norm")
# Norms on the residual stream, which sequence parallel splits along the sequence.
SEQUENCE_NORM_GLOBS = ("*.input_layernorm", "*.post_attention_layernorm", "*.pre_feedforward_layernorm",
                       "*.post_feedforward_layernorm", "model.norm", "norm")
# Multi-latent attention (DeepSeek-V3 style, transformers' names): the up-projections to heads are column-parallel
# (with the default plan's q_proj and o_proj); the latent down-projections and their norms stay whole (replicated)
# inside the attention block, whose input is whole there (sequence parallel gathers it at the block's entry).
MLA_COLWISE = ("*.q_b_proj", "*.kv_b_proj")
MLA_LATENT_GLOBS = ("*.q_a_proj", "*.q_a_layernorm", "*.kv_a_proj_with_mqa", "*.kv_a_layernorm")
# MTP depths (models/mtp.py): their norms and eh_proj act token by token on the residual stream.
MTP_TOKEN_WISE_GLOBS = ("mtp.layers.{*}.enorm", "mtp.layers.{*}.hnorm", "mtp.layers.{*}.final_layernorm",
                        "mtp.layers.{*}.eh_proj")
# Attributes some HF attention modules keep with their head counts; divided by tp when present.
_HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads")
_SEQ, _HEADS = Shard(1), Shard(2)  # activations are [batch, seq, hidden] / [batch, seq, heads, head_dim]


def _plan_names(model: nn.Module, globs: Sequence[str], field: str,
                exclude: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """(names of the modules the TP plan field `field` selects, minus `exclude`; problems)."""
    names = [name for name, _ in match_modules(model, globs)]
    if globs and not names:
        return [], [f"{field}: the globs {', '.join(globs)} match no module of {type(model).__name__} — "
                    f"use patterns such as {DEFAULT_COLWISE[0]!r}"]
    return [name for name in names if not matches(name, exclude)], []


def plan_modules(model: nn.Module, globs: Sequence[str], field: str, exclude: Sequence[str] = ()) -> List[str]:
    """Names of the modules the TP plan field `field` selects (`parallel.plans` globs), minus `exclude`.

    A glob may match nothing (the default plan names gate/up/down projections a model may not have) as long as
    the field as a whole matches something; a field that matches no module at all is a usage error.
    """
    names, problems = _plan_names(model, globs, field, exclude)
    if problems:
        raise UsageError(problems)
    return names


def _divisibility_problems(model: nn.Module, names: Sequence[str], tp: int, field: str) -> List[str]:
    problems = []
    for name in names:
        module = model.get_submodule(name)
        features = module.out_features if field == "tp_colwise" else module.in_features
        if features % tp:
            problems.append(f"{field}: {name} has {features} {'output' if field == 'tp_colwise' else 'input'} "
                            f"features, not divisible by tp_size={tp} — choose a tp size that divides it")
    return problems


def tensor_parallel_plan(model: nn.Module, tp: int, colwise: Sequence[str] = DEFAULT_COLWISE,
                         rowwise: Sequence[str] = DEFAULT_ROWWISE, sequence_parallel: bool = False,
                         exclude: Sequence[str] = (), token_local: Sequence[str] = ()
                         ) -> Tuple[List[str], List[str], List[str]]:
    """(column-parallel module names, row-parallel module names, problems): the plan `apply_tensor_parallel`
    carries out on `model` at `tp`, and every reason it cannot (head counts or layer sizes tp does not divide,
    globs that match nothing or both sides). The build's model check (`parallel.model_checks`) reports these
    with the other stages' before any stage runs."""
    config = model.config
    problems = tensor_parallel_problems(config.num_attention_heads, config.num_key_value_heads, tp)
    if sequence_parallel and config._attn_implementation == "eager":
        # eager builds its mask from the local (sequence-split) length; SDPA is the same math without a mask
        problems.append("sequence_parallel (--sequence-parallel): not supported with eager attention — use sdpa")
    if match_modules(model, ["*.kv_b_proj"]):  # multi-latent attention: its head projections join the plan
        colwise = list(colwise) + [glob for glob in MLA_COLWISE if glob not in colwise]
    col_names, col_problems = _plan_names(model, colwise, "tp_colwise", exclude)
    row_names, row_problems = _plan_names(model, rowwise, "tp_rowwise", exclude)
    col_names = [n for n in col_names if not inside(n, token_local)]
    row_names = [n for n in row_names if not inside(n, token_local)]
    problems += col_problems + row_problems
    both = sorted(set(col_names) & set(row_names))
    if both:
        problems.append(f"tp_colwise / tp_rowwise: {', '.join(both)} match both — make the globs disjoint")
    if tp >= 1:
        problems += _divisibility_problems(model, col_names, tp, "tp_colwise")
        problems += _divisibility_problems(model, row_names, tp, "tp_rowwise")
    return col_names, row_names, problems


def _as_dtensor(x, mesh: DeviceMesh, placement: Placement, desired: Optional[Placement]):
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    if placement == _SEQ and x.shape[1] % mesh.size():
        raise UsageError(f"sequence_parallel (--sequence-parallel): sequence length {x.shape[1]} is not divisible "
                         f"by tp_size={mesh.size()} — use a multiple of {mesh.size()} or drop sequence parallel")
    tensor = DTensor.from_local(x, mesh, [placement], run_check=False)
    return tensor if desired is None else tensor.redistribute(mesh, [desired])


def _to_local(out, mesh: DeviceMesh, desired: Optional[Placement]):
    if isinstance(out, DTensor):
        return local_tensor(out if desired is None else out.redistribute(mesh, [desired]))
    if isinstance(out, tuple):
        return tuple(_to_local(item, mesh, desired) for item in out)
    return out


def _partial_to_replicate(grad):
    # A replicated weight fed by sharded activations gets a Partial(sum) gradient; make it the full one.
    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def _replicate_module(module: nn.Module, mesh: DeviceMesh, memo: Dict[int, nn.Parameter], input_layout: Placement,
                      input_desired: Optional[Placement] = None, output_desired: Optional[Placement] = None) -> None:
    """Makes `module`'s own parameters Replicate DTensors and converts its first input / its output at the edges."""
    for name, param in list(module.named_parameters(recurse=False)):
        if id(param) not in memo:  # tied weights (embedding = lm_head) stay one parameter
            replicated = nn.Parameter(DTensor.from_local(param.data, mesh, [Replicate()], run_check=False),
                                      requires_grad=param.requires_grad)
            if replicated.requires_grad:
                replicated.register_hook(_partial_to_replicate)
            memo[id(param)] = replicated
        setattr(module, name, memo[id(param)])

    _convert_input(module, mesh, input_layout, input_desired)
    module.register_forward_hook(lambda _module, _args, out: _to_local(out, mesh, output_desired))


def _convert_input(module: nn.Module, mesh: DeviceMesh, layout: Placement, desired: Optional[Placement]) -> None:
    """Turns the module's first input (positional, or HF's `hidden_states=` keyword) into a DTensor."""

    def before(_module, args, kwargs):
        if args:
            args = (_as_dtensor(args[0], mesh, layout, desired),) + tuple(args[1:])
        elif "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=_as_dtensor(kwargs["hidden_states"], mesh, layout, desired))
        return args, kwargs

    module.register_forward_pre_hook(before, with_kwargs=True)


def _gather_sequence_into_blocks(model: nn.Module, mesh: DeviceMesh, colwise: Sequence[str]) -> None:
    """Sequence parallel: each block holding column-parallel layers (attention, MLP) all-gathers its input."""
    for parent in sorted({name.rsplit(".", 1)[0] for name in colwise if "." in name}):
        _convert_input(model.get_submodule(parent), mesh, _SEQ, Replicate())


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, colwise: Sequence[str] = DEFAULT_COLWISE,
                          rowwise: Sequence[str] = DEFAULT_ROWWISE, sequence_parallel: bool = False,
                          exclude: Sequence[str] = (), token_local: Sequence[str] = ()) -> nn.Module:
    """Shards an HF decoder model over the 1-D `tp_mesh` in place and returns it.

    Call before context parallel, recompute and FSDP. `exclude`: globs of modules to leave untouched (e.g. MoE
    experts that expert parallel shards next). `token_local`: names of MoE blocks that run on each rank's own
    tokens with whole weights (`moe_tensor_parallel`, expert tensor-parallel size 1). Raises UsageError for head counts or layer sizes tp does not divide.
    """
    tp = tp_mesh.size()
    # a run's model check reported these already (parallel.model_checks); a direct caller gets them here
    col_names, row_names, problems = tensor_parallel_plan(model, tp, colwise, rowwise, sequence_parallel, exclude,
                                                          token_local)
    if problems:
        raise UsageError(problems)

    plan: Dict[str, object] = {name: ColwiseParallel() for name in col_names}
    # Sequence parallel: o/down reduce-scatter to sequence shards instead of all-reducing.
    plan.update({name: RowwiseParallel(output_layouts=_SEQ if sequence_parallel else Replicate())
                 for name in row_names})
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel:
        _gather_sequence_into_blocks(model, tp_mesh, col_names)

    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            for attribute in _HEAD_COUNT_ATTRIBUTES:
                if isinstance(getattr(module, attribute, None), int):
                    setattr(module, attribute, getattr(module, attribute) // tp)
    make_token_local(model, tp_mesh, token_local, exclude, sequence_parallel, {})
    _replicate_the_rest(model, tp_mesh, sequence_parallel, exclude)
    _mtp_layer_edges(model, tp_mesh, sequence_parallel)
    if sequence_parallel:
        model.register_forward_pre_hook(_full_position_ids, with_kwargs=True)
    return model


def _mtp_layer_edges(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """MTP depths (models/mtp.py) are called by the lm head with its (distributed) input: each depth takes its
    hidden states into the residual stream's layout (this rank's sequence shard under sequence parallel, else the
    whole sequence) and hands back its outputs as distributed tensors, which the head's weight multiplies."""
    residual = _SEQ if sequence_parallel else Replicate()

    def before(_module, args):
        hidden = args[0]
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(mesh, [residual]).to_local()
        return (hidden,) + tuple(args[1:])

    def after(_module, _args, out):
        return tuple(DTensor.from_local(t, mesh, [residual], run_check=False) for t in out)

    for _, layer in match_modules(model, ["mtp.layers.{*}"]):
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)


def _full_position_ids(_model, args, kwargs):
    # HF derives default positions from the embedding output, which sequence parallel has split: give the full ones.
    input_ids = args[0] if args else kwargs.get("input_ids")
    if kwargs.get("position_ids") is None and input_ids is not None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        kwargs = dict(kwargs, position_ids=positions)
    return args, kwargs


def _replicate_the_rest(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, exclude: Sequence[str]) -> None:
    embedding, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    memo: Dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or all(isinstance(p, DTensor) for p in own) or matches(name, exclude):
            continue
        if module is embedding:
            _replicate_module(module, mesh, memo, Replicate(), output_desired=_SEQ if sequence_parallel else None)
        elif module is lm_head:
            _replicate_module(module, mesh, memo, _SEQ if sequence_parallel else Replicate(),
                              input_desired=Replicate() if sequence_parallel else None)
        elif matches(name, MLA_LATENT_GLOBS):
            _replicate_module(module, mesh, memo, Replicate())
        elif matches(name, HEAD_NORM_GLOBS):
            _replicate_module(module, mesh, memo, _HEADS)
        elif sequence_parallel and matches(name, SEQUENCE_NORM_GLOBS + MTP_TOKEN_WISE_GLOBS):
            _replicate_module(module, mesh, memo, _SEQ)
        elif sequence_parallel:
            raise UsageError(f"sequence_parallel (--sequence-parallel): does not know how {name} "
                             f"({type(module).__name__}) sees the sequence — drop sequence parallel for this model")
        else:
            _replicate_module(module, mesh, memo, Replicate())
