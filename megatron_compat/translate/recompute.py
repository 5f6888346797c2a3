"""Megatron's recomputation flags → parallel.recompute and parallel.recompute_modules (plan globs).

full / uniform: every layer (chunks of N layers hold the same math); full / block: the first N layers of each
pipeline stage; selective: the named sub-modules (core_attn, mlp, moe, layernorm, ...).
"""
from __future__ import annotations

from typing import Any, List

from megatron_compat.translate.handler_table import handles

# --- recomputation --------------------------------------------------------------------------------------------
_SELECTIVE = {"core_attn": ["model.layers.{*}.self_attn"], "mla_up_proj": ["model.layers.{*}.self_attn"],
              "mlp": ["model.layers.{*}.mlp"], "moe": ["model.layers.{*}.mlp"],
              # `shared_expert` or, in DeepSeek-style models, `shared_experts`: the engine takes the one the model has
              "moe_act": ["model.layers.{*}.mlp.experts"], "shared_experts": ["model.layers.{*}.mlp.shared_expert"],
              "layernorm": ["model.layers.{*}.input_layernorm", "model.layers.{*}.post_attention_layernorm"]}


def _granularity(ctx) -> Any:
    if ctx.get("checkpoint_activations"):
        return "full"  # Megatron's deprecated spelling of full/uniform
    if ctx.get("recompute_activations"):
        return "selective"
    return ctx.get("recompute_granularity")


@handles("recompute_granularity", "parallel.recompute + parallel.recompute_modules")
def _recompute(ctx, value):
    granularity = _granularity(ctx)
    if granularity is None:
        return
    ctx.set("parallel.recompute", True)
    if granularity == "selective":
        modules: List[str] = []
        for name in ctx.get("recompute_modules") or ["core_attn"]:
            if name not in _SELECTIVE:
                ctx.decline("recompute_modules", f"unknown module '{name}' — use {', '.join(_SELECTIVE)}")
                continue
            modules += [m for m in _SELECTIVE[name] if m not in modules]
        ctx.set("parallel.recompute_modules", modules)
        return
    ctx.set("parallel.recompute_modules", _full_recompute_modules(ctx))


def _full_recompute_modules(ctx) -> List[str]:
    """uniform: every layer (chunks of N layers hold the same math); block: the first N layers of each stage."""
    method, n = ctx.get("recompute_method") or "uniform", ctx.get("recompute_num_layers") or 1
    layers, stages = ctx.get("num_layers"), ctx.get("pipeline_model_parallel_size") or 1
    if method != "block" or not layers:
        return ["model.layers.{*}"]
    per_stage = max(layers // stages, 1)
    return [f"model.layers.{i}" for i in range(layers) if i % per_stage < n]


for _dest in ("recompute_method", "recompute_num_layers", "recompute_modules", "recompute_activations",
              "checkpoint_activations"):
    @handles(_dest, "parallel.recompute_modules")
    def _recompute_detail(ctx, value, _dest=_dest):
        if _dest in ctx.active and _granularity(ctx) is None:
            ctx.record(_dest, "no_effect", "Megatron reads it only with --recompute-granularity")
