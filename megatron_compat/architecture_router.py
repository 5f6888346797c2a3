"""Megatron's MoE router flags → native `model.moe_router_*` fields or HF config keys (part of `architecture`).

Families in `ROUTER_FAMILIES` run this project's router (`fsdp2_backend/models/moe/router.py`, megatron-core's
routing and losses exactly): the flags the script gives become `model.moe_router_*` fields — only those given,
so Megatron's defaults leave the HF model's own routing in place. Other families run transformers' model: its
router and aux loss with Megatron's coefficient (`router_aux_loss_coef`), and the options it lacks declined.
`a` is `architecture.Arch` (flag values, dispositions, fields).
"""
from __future__ import annotations


ROUTER_FAMILIES = ("qwen3_moe",)
_ROUTER_FIELDS = (("moe_router_score_function", "moe_router_score_function"),
                  ("moe_router_topk_scaling_factor", "moe_router_topk_scaling_factor"),
                  ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
                  ("moe_router_num_groups", "moe_router_num_groups"), ("n_group", "moe_router_num_groups"),
                  ("moe_router_group_topk", "moe_router_group_topk"), ("topk_group", "moe_router_group_topk"),
                  ("moe_z_loss_coeff", "moe_z_loss_coeff"), ("moe_router_dtype", "moe_router_dtype"))


def megatron_router(a) -> None:
    """Megatron's router flags → `model.moe_router_*` (megatron-core's routing and losses, exactly)."""
    g = a.get
    balancing, coeff = g("moe_router_load_balancing_type"), g("moe_aux_loss_coeff")
    if g("seq_aux"):  # MindSpeed's --seq-aux: the sequence-level loss in place of the batch-level one
        balancing = [("seq_aux_loss" if b == "aux_loss" else b) for b in balancing] \
            if isinstance(balancing, list) else ("seq_aux_loss" if balancing == "aux_loss" else balancing)
        a.field("seq_aux", "model.moe_router_load_balancing_type", balancing)
    kinds = balancing if isinstance(balancing, list) else [balancing]
    coeffs = coeff if isinstance(coeff, list) else [coeff] * len(kinds)
    if "sinkhorn" in kinds or any(c for k, c in zip(kinds, coeffs) if k.endswith("aux_loss")):
        a.field("moe_router_load_balancing_type", "model.moe_router_load_balancing_type", balancing)
        a.field("moe_aux_loss_coeff", "model.moe_aux_loss_coeff", coeff)
    else:  # Megatron adds no load-balancing loss: nor does the model (transformers' aux loss stays off)
        for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "seq_aux"):
            a.note(dest, "no_effect", "no load-balancing loss (its coefficient is 0), as in Megatron")
    for dest, target in _ROUTER_FIELDS:  # only those given: Megatron's defaults are the HF model's routing
        if dest in a.active:
            a.field(dest, f"model.{target}", g(dest))
    if g("moe_router_enable_expert_bias"):
        a.field("moe_router_enable_expert_bias", "model.moe_router_enable_expert_bias", True)
        a.field("moe_router_bias_update_rate", "model.moe_router_bias_update_rate", g("moe_router_bias_update_rate"))
    elif "moe_router_bias_update_rate" in a.active:
        a.note("moe_router_bias_update_rate", "no_effect", "read only with --moe-router-enable-expert-bias")


def hf_router_keys(a, family: str) -> None:
    """Other families run transformers' model: its router and aux loss, with Megatron's coefficient."""
    g = a.get
    balancing = g("moe_router_load_balancing_type")
    balancing = balancing[0] if isinstance(balancing, list) else balancing
    coeff = g("moe_aux_loss_coeff")
    coeff = coeff[0] if isinstance(coeff, list) else coeff
    if balancing not in ("aux_loss", "none"):
        a.decline("moe_router_load_balancing_type", f"'{balancing}' load balancing is not implemented (only "
                  "aux_loss and none) — use --moe-router-load-balancing-type aux_loss")
    else:
        a.put("moe_router_load_balancing_type", "output_router_logits", balancing == "aux_loss" and coeff > 0)
    a.put("moe_aux_loss_coeff", "router_aux_loss_coef", 0.0 if balancing == "none" else coeff)
    if g("moe_z_loss_coeff"):
        a.decline("moe_z_loss_coeff", "the router z-loss is not implemented — drop --moe-z-loss-coeff")
    elif "moe_z_loss_coeff" in a.active:
        a.note("moe_z_loss_coeff", "no_effect", "a z-loss coefficient of 0 adds nothing")
    if g("seq_aux"):
        a.decline("seq_aux", "the sequence-level auxiliary loss needs this project's router (a qwen3_moe model) "
                  "— drop --seq-aux")
