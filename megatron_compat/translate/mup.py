"""Megatron-LM's µP flags (`--use-mup`, `--mup-*`) → `model.use_mup` / `model.mup_*` (models/mup.py).

Megatron reads the `--mup-*` values only with `--use-mup` (TransformerConfig.__post_init__), so without it they
have no effect. `--mup-output-mult 1.0` (its default) means "1 / width multiplier" there, hence unset here.
`--mup-width-mult` is derived (hidden / base hidden) and overwritten by Megatron whatever its value.
"""
from __future__ import annotations

from megatron_compat.translate.handler_table import handles

_FIELDS = ("mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
           "mup_attn_scale_power")


@handles("use_mup", "model.use_mup")
def _use_mup(ctx, value):
    if value:
        ctx.set("model.use_mup", True)


for _dest in _FIELDS:
    @handles(_dest, f"model.{_dest}")
    def _mup_field(ctx, value, _dest=_dest):
        if _dest not in ctx.active:
            return
        if not ctx.get("use_mup"):
            ctx.record(_dest, "no_effect", "Megatron reads it only with --use-mup")
        elif _dest == "mup_output_mult" and value == 1.0:
            ctx.record(_dest, "mapped", "model.mup_output_mult (1.0: Megatron's 1 / width multiplier, unset)")
        else:
            ctx.set(f"model.{_dest}", value)


@handles("mup_width_mult", "(derived: hidden size / --mup-base-hidden-size)")
def _width_mult(ctx, value):
    if "mup_width_mult" in ctx.active:
        ctx.record("mup_width_mult", "no_effect", "Megatron derives it from --hidden-size / --mup-base-hidden-size "
                                                  "and overwrites the given value")
