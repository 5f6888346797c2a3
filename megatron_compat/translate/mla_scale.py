"""MindSpeed-LLM's MLA latent scales → `model.mla_scale_q_lora` / `model.mla_scale_kv_lora` (models/mla_lora_scale.py).

`--enable-mla-scale-q-lora` multiplies the normalised query latent by sqrt(hidden / q_lora_rank) before its
up-projection, `--enable-mla-scale-kv-lora` the normalised key/value latent by sqrt(hidden / kv_lora_rank); the HF
export folds the factors into q_b_proj / kv_b_proj. MindSpeed reads them only in its multi-latent attention, so
without `--multi-latent-attention` they have no effect; the query factor needs a query latent (`--q-lora-rank`:
MindSpeed divides by it).
"""
from __future__ import annotations

from megatron_compat.translate.handler_table import handles


def _mla(ctx) -> bool:
    return bool(ctx.get("multi_latent_attention") or ctx.get("multi_head_latent_attention"))


for _dest, _field in (("enable_mla_scale_q_lora", "model.mla_scale_q_lora"),
                      ("enable_mla_scale_kv_lora", "model.mla_scale_kv_lora")):
    @handles(_dest, _field)
    def _scale(ctx, value, _dest=_dest, _field=_field):
        if not value:
            return
        if not _mla(ctx):
            ctx.record(_dest, "no_effect", f"MindSpeed reads it only in multi-latent attention "
                                           f"(--multi-latent-attention; with it: {_field}, folded into the "
                                           f"up-projection on HF export)")
        elif _dest == "enable_mla_scale_q_lora" and not ctx.get("q_lora_rank"):
            ctx.decline(_dest, "scales the query latent, which this model does not have (no --q-lora-rank; "
                               "MindSpeed divides by it) — add --q-lora-rank or drop the flag")
        else:
            ctx.set(_field, True)
