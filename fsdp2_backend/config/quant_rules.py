"""The config rules of quantised training (`model.quant_*`, low-precision all-gather), torch-free.

`check_quantization` appends errors: the quant fields without a recipe; unknown converter names (listing the
known ones); torchao missing; layouts the MXFP8 weights do not support yet (tensor and expert parallel); FP8
recipes under context parallel (tensor parallel takes their scales over the tp ranks: `parallel/float8_tp.py`).
`quant_notices` lists fields with no effect in the chosen mode (reported once).
"""
from __future__ import annotations

import importlib.util
from typing import List

from fsdp2_backend.config.schema import Config
from fsdp2_backend.config.quant_names import (CONVERTERS, EXPERTS_CONVERTER, FLOAT8_LINEAR_CONVERTER,
                                             FLOAT8_RECIPES, MX_CONVERTERS)

# Model fields that only a quantisation recipe reads.
QUANT_ONLY_MODEL_FIELDS = ("quant_apply_modules", "quant_ignored_modules", "quant_converters",
                           "enable_fsdp_low_precision_all_gather", "fsdp_low_precision_all_gather_mode",
                           "quant_fp8_format", "quant_fp8_amax_history_len", "quant_fp8_amax_compute_algo",
                           "quant_fp8_margin")
DELAYED_ONLY_FIELDS = ("quant_fp8_amax_history_len", "quant_fp8_amax_compute_algo", "quant_fp8_margin")


def check_quantization(config: Config, errors: List[str]) -> None:
    m, p = config.model, config.parallel
    if m.quant_recipe_name is None:
        defaults = Config().model
        errors.extend(f"model.{name}: only used with model.quant_recipe_name — set quant_recipe_name: mxfp8, or "
                      f"unset it" for name in QUANT_ONLY_MODEL_FIELDS if getattr(m, name) != getattr(defaults, name))
        return
    unknown = [name for name in m.quant_converters if name not in CONVERTERS]
    if unknown:
        errors.append(f"model.quant_converters: unknown converter(s) {', '.join(map(repr, unknown))} — known: "
                      f"{', '.join(CONVERTERS)}")
    elif not m.quant_converters:
        errors.append(f"model.quant_converters: empty, so nothing would be quantised — name at least one of "
                      f"{', '.join(CONVERTERS)}")
    if not m.quant_apply_modules:
        errors.append("model.quant_apply_modules: empty, so nothing would be quantised — give module patterns "
                      "such as 'model.layers.{*}'")
    float8 = m.quant_recipe_name in FLOAT8_RECIPES
    wrong = [name for name in m.quant_converters if name in CONVERTERS and (name in MX_CONVERTERS) == float8]
    if wrong:
        errors.append(f"model.quant_converters: {', '.join(wrong)} do not go with quant_recipe_name "
                      f"{m.quant_recipe_name} — use {FLOAT8_LINEAR_CONVERTER if float8 else ', '.join(MX_CONVERTERS)}")
    if float8 and m.quant_fp8_amax_history_len < 1:
        errors.append(f"model.quant_fp8_amax_history_len: {m.quant_fp8_amax_history_len} — the history holds at "
                      f"least the current step's amax: give 1 or more")
    if float8:
        # tensor and context parallel take the scales over their ranks (parallel/float8_tp.py); a blockwise
        # 128-token block must lie on one rank (ring attention holds 2 chunks of seq / (2 cp) tokens per sample)
        span = 2 * p.cp_size * 128
        if p.cp_size > 1 and m.quant_recipe_name == "blockwise" and config.data.cutoff_len % span:
            errors.append(f"model.quant_recipe_name: blockwise FP8 under context parallel needs the weight "
                          f"gradient's 128-token blocks whole on one rank: data.cutoff_len {config.data.cutoff_len} "
                          f"is not a multiple of 2 × cp_size × 128 = {span} — use such a sequence length, or "
                          f"quant_recipe_name tensorwise / rowwise")
        return
    if m.quant_fp8_format != "e4m3":
        errors.append("model.quant_fp8_format: hybrid (E5M2 gradients) is not part of the mxfp8 recipe — use e4m3, "
                      "or quant_recipe_name tensorwise / rowwise / blockwise")
    if importlib.util.find_spec("torchao") is None:
        errors.append("model.quant_recipe_name: mxfp8 needs torchao — pip install torchao (megatron-fsdp2[quant])")
    if p.tp_size > 1:
        errors.append("model.quant_recipe_name: MXFP8 weights are not supported with tensor parallel yet (the "
                      "weight wrapper is not a TP DTensor shard) — use parallel.tp_size 1, or drop quantisation")
    if (p.ep_size > 1 or p.ep_fsdp_size > 1) and EXPERTS_CONVERTER in m.quant_converters:
        errors.append(f"model.quant_converters: {EXPERTS_CONVERTER} is not supported with expert parallel yet — "
                      f"use ep_size 1, or drop {EXPERTS_CONVERTER}")


def quant_notices(config: Config) -> List[str]:
    m = config.model
    if m.quant_recipe_name is None:
        return []
    notices = []
    if m.quant_recipe_name != "delayed":
        defaults = Config().model
        notices += [f"model.{name}: no effect with quant_recipe_name {m.quant_recipe_name} (read by the delayed "
                    f"recipe only)" for name in DELAYED_ONLY_FIELDS if getattr(m, name) != getattr(defaults, name)]
    if m.quant_recipe_name in FLOAT8_RECIPES:
        if m.enable_fsdp_low_precision_all_gather:
            notices.append(f"model.enable_fsdp_low_precision_all_gather: the {m.quant_recipe_name} FP8 weights are "
                           "gathered in param_dtype and quantised after the gather (the values an FP8 all-gather "
                           "with the all-reduced scale gives; no communication saved)")
        return notices
    if not m.enable_fsdp_low_precision_all_gather and m.fsdp_low_precision_all_gather_mode != "on-demand":
        notices.append("model.fsdp_low_precision_all_gather_mode: no effect without "
                       "enable_fsdp_low_precision_all_gather (weights are gathered in param_dtype)")
    if (m.enable_fsdp_low_precision_all_gather and m.fsdp_low_precision_all_gather_mode == "on-demand"
            and config.parallel.recompute):
        notices.append("model.fsdp_low_precision_all_gather_mode: on-demand gathers both quantisations at once "
                       "with parallel.recompute (the recomputed forward runs inside backward)")
    return notices
