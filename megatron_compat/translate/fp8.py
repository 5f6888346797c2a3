"""Megatron's FP8 training flags → `model.quant_*` (the quantize stage, `fsdp2_backend/parallel/quantize.py`).

--fp8-format F --fp8-recipe R (megatron-core `TransformerConfig.fp8` / `fp8_recipe`, Transformer Engine recipes):
  mxfp8       model.quant_recipe_name mxfp8 (MX blocks of 32, E8M0 scales); E4M3 only (`hybrid`'s E5M2 gradients
              are not part of the MX recipe here)
  tensorwise  model.quant_recipe_name tensorwise (TE's Float8CurrentScaling: one scale per tensor, computed from the
              tensor itself), quant_fp8_format F (hybrid: E5M2 gradients)
  blockwise   model.quant_recipe_name blockwise (TE's Float8BlockScaling, DeepSeek-V3's: 1×128 activations and
              gradients, 128×128 weights), quant_fp8_format F
  delayed     model.quant_recipe_name delayed (TE's DelayedScaling, Megatron's default: one scale per tensor from an
              amax history, `fsdp2_backend/parallel/float8_delayed.py`), quant_fp8_format F
  custom      declined: a quantizer factory is Python code of the user's
--fp8-param-gather: model.enable_fsdp_low_precision_all_gather.
--fp8-margin / --fp8-amax-history-len / --fp8-amax-compute-algo → model.quant_fp8_margin / _amax_history_len /
  _amax_compute_algo, read by the delayed recipe only; --fp8-interval has no effect (TE >= 1.8 ignores it, Megatron
  warns).
--first-last-layers-bf16 (--num-layers-at-start-in-bf16 N, --num-layers-at-end-in-bf16 M, default 1 each): the
  first N and last M decoder layers stay high precision → model.quant_ignored_modules.
"""
from __future__ import annotations

from megatron_compat.translate.handler_table import handles

_FLOAT8_CONVERTER = "quantize.linear.float8"  # = fsdp2_backend.config.quant_names.FLOAT8_LINEAR_CONVERTER
_DELAYED_FIELDS = {"fp8_amax_history_len": "quant_fp8_amax_history_len",
                   "fp8_amax_compute_algo": "quant_fp8_amax_compute_algo", "fp8_margin": "quant_fp8_margin"}


@handles("fp8", "model.quant_recipe_name (the --fp8-recipe)")
def _fp8_format(ctx, value):
    """--fp8-format (dest fp8) with its --fp8-recipe."""
    if value is None:
        return
    recipe = ctx.get("fp8_recipe")
    if recipe == "custom":
        ctx.decline("fp8", "--fp8-recipe custom: Transformer Engine's custom FP8 recipe (a quantizer factory of "
                           "your own) is not available (it would change the numerics) — use --fp8-recipe "
                           "tensorwise, blockwise or mxfp8, or drop the fp8 flags to train in bf16")
        return
    if recipe == "mxfp8" and value != "e4m3":
        ctx.decline("fp8", f"--fp8-format {value}: E5M2 gradients are not part of the MXFP8 recipe here (E4M3 for "
                           "activations, weights and gradients) — use --fp8-format e4m3, or --fp8-recipe tensorwise")
        return
    ctx.set("model.quant_recipe_name", recipe)
    if recipe != "mxfp8":
        ctx.set("model.quant_converters", [_FLOAT8_CONVERTER])
        ctx.set("model.quant_fp8_format", value)
    if recipe == "delayed":  # Megatron's default recipe: its history settings (Megatron's defaults when not given)
        for dest, field in _DELAYED_FIELDS.items():
            ctx.set_from(dest, f"model.{field}", ctx.get(dest))
    ctx.set("model.enable_fsdp_low_precision_all_gather", bool(ctx.get("fp8_param_gather")))


@handles("fp8_recipe", "model.quant_recipe_name (with --fp8-format)")
def _fp8_recipe(ctx, value):
    if ctx.get("fp8") is None and "fp8_recipe" in ctx.active:
        ctx.record("fp8_recipe", "no_effect", "Megatron reads it only with --fp8-format")


@handles("fp8_param_gather", "model.enable_fsdp_low_precision_all_gather (with --fp8-format)")
def _fp8_param_gather(ctx, value):
    if value and ctx.get("fp8") is None:
        ctx.record("fp8_param_gather", "no_effect", "without --fp8-format parameters are gathered in bf16")


for _dest in _DELAYED_FIELDS:
    @handles(_dest, f"model.{_DELAYED_FIELDS[_dest]} (with --fp8-recipe delayed)")
    def _delayed_only(ctx, value, _dest=_dest):
        if _dest not in ctx.active:
            return
        if ctx.get("fp8") is not None and ctx.get("fp8_recipe") == "delayed":
            ctx.record(_dest, "mapped", f"model.{_DELAYED_FIELDS[_dest]}")
        else:
            ctx.record(_dest, "no_effect", "read only by --fp8-recipe delayed")


@handles("fp8_interval", "(no effect: Transformer Engine >= 1.8 ignores it)")
def _fp8_interval(ctx, value):
    if "fp8_interval" in ctx.active:
        ctx.record("fp8_interval", "no_effect", "Transformer Engine 1.8 and later ignore it (Megatron warns): the "
                                                "delayed scales are updated after every step")


@handles("first_last_layers_bf16", "model.quant_ignored_modules (the first and last decoder layers)")
def _first_last_layers_bf16(ctx, value):
    if not value:
        return
    if ctx.get("fp8") is None:
        ctx.record("first_last_layers_bf16", "no_effect", "read only with --fp8-format")
        return
    layers, start, end = ctx.get("num_layers"), ctx.get("num_layers_at_start_in_bf16"), \
        ctx.get("num_layers_at_end_in_bf16")
    if not layers:
        ctx.decline("first_last_layers_bf16", "the last layers cannot be named without the layer count — give "
                                              "--num-layers (or list them in model.quant_ignored_modules)")
        return
    from fsdp2_backend.config.schema import ModelArguments

    kept = sorted(set(range(min(start, layers))) | set(range(max(layers - end, 0), layers)))
    ctx.set("model.quant_ignored_modules",
            list(ModelArguments().quant_ignored_modules) + [f"model.layers.{i}" for i in kept])


for _dest in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
    @handles(_dest, "model.quant_ignored_modules (with --first-last-layers-bf16)")
    def _layers_in_bf16(ctx, value, _dest=_dest):
        if _dest in ctx.active and not (ctx.get("first_last_layers_bf16") and ctx.get("fp8") is not None):
            ctx.record(_dest, "no_effect", "read only with --first-last-layers-bf16 and --fp8-format")
