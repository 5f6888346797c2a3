"""The `quantize` plan stage (first in the fixed order): MXFP8 or FP8 training for the modules the config names.

Selection (MindSpeed-LLM's fields): a module is converted when its name or an ancestor's matches
`model.quant_apply_modules` and neither its name nor an ancestor's matches `model.quant_ignored_modules`
(patterns as in every plan, `fsdp2_backend.parallel.plans`; the defaults keep `lm_head` and MoE routers
(`*gate`) in high precision). Converters (`model.quant_converters`, names in `config.quant_names`):

- `quantize.linear.mx`: an `nn.Linear`'s weight becomes an `MXTrainingWeight` (`parallel.mx.weight`): its
  forward and both backward GEMMs run in MXFP8 (`kernels.mx_linear`); both dims must be multiples of 32
  (MX blocks), others stay high precision and are listed once;
- `quantize.moe.mx`: stacked MoE experts (`GroupedExperts`) run the MXFP8 grouped GEMM
  (`kernels.mx_linear.mx_grouped_linear`) through their `gemm` hook; their weights gather in high precision;
- `quantize.linear.float8` (recipes tensorwise / rowwise / blockwise / delayed, `kernels.float8`; delayed's
  amax histories: `float8_delayed`, updated by an after-step hook): an `nn.Linear`'s
  forward becomes `float8_linear` on the instance (its weight stays a plain parameter, gathered by FSDP in
  param_dtype and quantised in the call; under tensor parallel `float8_tp` quantises each rank's shards with the
  whole tensor's scales); blockwise needs whole 128×128 weight blocks, others stay high precision.

Master weights, optimizer state, checkpoints and the HF export stay unquantised: the state dict of a
converted module holds the plain weight (`unwrap`), which shares storage with the wrapper, so loading into it
in place loads the weight. `finish_after_fsdp` runs after FSDP: it decides per weight whether the all-gather
can be low precision (the shard must hold whole 32-row blocks) and, for units that keep their gathered
weights through backward (no reshard after forward) or recompute their forward inside backward, gathers both
quantisations at once.
"""
from __future__ import annotations

import functools
from typing import List

from torch import nn

from fsdp2_backend.config import Config
from fsdp2_backend.config.quant_names import EXPERTS_CONVERTER, FLOAT8_LINEAR_CONVERTER, LINEAR_CONVERTER
from fsdp2_backend.parallel.mx.weight import MXSettings, MXTrainingWeight, unwrap
from fsdp2_backend.parallel.plans import lenient_matches, matches
from fsdp2_backend.kernels.mx import BLOCK
from fsdp2_backend.kernels.float8 import BLOCK as FLOAT8_BLOCK, blockwise_supported, float8_linear


def _selected(name: str, apply: List[str], ignored: List[str]) -> bool:
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(matches(p, apply) for p in prefixes) and not any(matches(p, ignored) for p in prefixes)


def _unwrap_state_dict(module: nn.Module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = unwrap(state_dict[key])


def apply_quantization(model: nn.Module, config: Config, token_group=None) -> List[str]:
    """Converts the selected modules in place; returns the names of the converted modules. `token_group`: the
    context-parallel group that splits the tokens (FP8 scales over tokens are taken over it)."""
    from fsdp2_backend.models.moe.experts import GroupedExperts
    from fsdp2_backend.distributed.console import print_rank0
    from fsdp2_backend.kernels.mx_linear import mx_grouped_linear

    m = config.model
    lenient_matches(model, m.quant_apply_modules, "model.quant_apply_modules")
    converted, skipped, float8_modules = [], [], []
    for name, module in model.named_modules():
        if not name or not _selected(name, m.quant_apply_modules, m.quant_ignored_modules):
            continue
        if FLOAT8_LINEAR_CONVERTER in m.quant_converters and isinstance(module, nn.Linear):
            if m.quant_recipe_name == "blockwise" and not blockwise_supported(module.weight.shape):
                skipped.append(name)
                continue
            module.forward = functools.partial(_float8_forward, module, m.quant_recipe_name, m.quant_fp8_format,
                                               token_group)
            converted.append(name)
            float8_modules.append(module)
        elif LINEAR_CONVERTER in m.quant_converters and isinstance(module, nn.Linear):
            if module.in_features % BLOCK or module.out_features % BLOCK:
                skipped.append(name)
                continue
            settings = MXSettings(low_precision_gather=m.enable_fsdp_low_precision_all_gather,
                                  mode=m.fsdp_low_precision_all_gather_mode)
            weight = module.weight
            module.weight = nn.Parameter(MXTrainingWeight(weight.data, settings), requires_grad=weight.requires_grad)
            module.register_state_dict_post_hook(_unwrap_state_dict)
            converted.append(name)
        elif EXPERTS_CONVERTER in m.quant_converters and isinstance(module, GroupedExperts):
            dims = module.gate_up_proj.shape[1:] + module.down_proj.shape[1:]
            if any(d % BLOCK for d in dims):
                skipped.append(name)
                continue
            module.gemm = mx_grouped_linear
            converted.append(name)
    if m.quant_recipe_name == "delayed":
        _delayed_scaling(model, m, converted, float8_modules)
    if EXPERTS_CONVERTER in m.quant_converters and not any(isinstance(x, GroupedExperts) for x in model.modules()):
        print_rank0(f"notice: model.quant_converters: {EXPERTS_CONVERTER} found no stacked experts (GroupedExperts) in "
                    f"{type(model).__name__}; its experts stay high precision — set model.model_id (e.g. qwen3_moe)")
    if skipped:
        block = f"{FLOAT8_BLOCK} (128x128 blocks)" if m.quant_recipe_name == "blockwise" else f"{BLOCK} (MX blocks)"
        print_rank0(f"notice: model.quant_recipe_name: {len(skipped)} module(s) stay high precision, a dim not a "
                    f"multiple of {block}: {', '.join(skipped)}")
    how = "emulated unless the device has MX GEMMs" if m.quant_recipe_name == "mxfp8" else "emulated FP8 GEMMs"
    print_rank0(f"quantisation: {m.quant_recipe_name} in {len(converted)} module(s) ({how})")
    return converted


def _delayed_scaling(model: nn.Module, m, names: List[str], modules: List[nn.Linear]) -> None:
    """The delayed recipe: one history per scaled tensor of the converted linears (`float8_delayed`), updated
    after each optimizer step and kept in the checkpoint."""
    from fsdp2_backend.parallel.float8_delayed import DelayedScaling, attach
    from fsdp2_backend.training.optimizer_step import step_hooks

    state = DelayedScaling(names, m.quant_fp8_amax_history_len, m.quant_fp8_amax_compute_algo, m.quant_fp8_margin,
                           m.quant_fp8_format)
    for index, module in enumerate(modules):
        module.__dict__["_fp8_quantizer"] = state.quantizer(index, module)
    attach(model, state)
    step_hooks(model).after_step["fp8_delayed"] = state.after_step


def _float8_forward(module: nn.Linear, recipe: str, grad_format: str, token_group, x):
    """`module`'s forward with its GEMMs in FP8 (the weight as FSDP hands it in, i.e. gathered; under tensor
    parallel a DTensor on the tp mesh, whose scales `float8_tp` takes over the tp ranks, and over the cp ranks
    for the token dim under context parallel)."""
    from torch.distributed.tensor import DTensor

    delayed = module.__dict__.get("_fp8_quantizer")  # the delayed recipe's: its scales are the whole tensor's
    if isinstance(module.weight, DTensor):
        from fsdp2_backend.parallel.float8_tp import float8_linear_tp

        return float8_linear_tp(x, module.weight, module.bias, recipe, grad_format, token_group, quantize=delayed)
    if delayed is not None:
        return float8_linear(x, module.weight, module.bias, recipe=recipe, grad_format=grad_format,
                             quantize=delayed)
    if token_group is not None:
        from fsdp2_backend.parallel.float8_tp import ShardQuantizer

        return float8_linear(x, module.weight, module.bias, recipe=recipe, grad_format=grad_format,
                             quantize=ShardQuantizer({"M": token_group}))
    return float8_linear(x, module.weight, module.bias, recipe=recipe, grad_format=grad_format)


def mx_weights(model: nn.Module):
    """(name, MXTrainingWeight local tensor) for every converted weight of `model` (FSDP'd or not)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, MXTrainingWeight):
            yield name, local


def finish_after_fsdp(model: nn.Module, recompute: bool) -> None:
    """Per FSDP parameter: low-precision gather only where the shard holds whole column blocks; both
    quantisations in one gather where backward gets no gather of its own (or recomputes the forward)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        group = unit._get_fsdp_state()._fsdp_param_group
        for fsdp_param in (group.fsdp_params if group is not None else ()):
            local = fsdp_param._sharded_local_tensor
            if not isinstance(local, MXTrainingWeight):
                continue
            settings = local.settings
            world = fsdp_param.mesh_info.shard_mesh_size
            rows = fsdp_param._orig_size[0]
            # One rank gathers nothing (and FSDP2's 1-rank path copies a single all-gather input only).
            if world == 1 or rows % (world * BLOCK):
                settings.low_precision_gather = False
            if fsdp_param.post_forward_mesh_info is None or recompute:
                settings.gather_both = True
