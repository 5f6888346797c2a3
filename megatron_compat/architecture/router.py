"""Megatron's MoE router flags → native `model.moe_router_*` fields or HF config keys (part of `architecture`).

Families in `ROUTER_FAMILIES` (every MoE family the flags build) run this project's router
(`fsdp2_backend/models/moe/router.py`, megatron-core's routing and losses exactly; `models/qwen3_moe/modeling.py`,
`models/moe/family_swap.py`): the flags the script gives become `model.moe_router_*` fields — only those given,
so Megatron's defaults leave the HF model's own routing in place. `hf_router_keys` (transformers' router and aux
loss with Megatron's coefficient, the options it lacks declined) is for a family outside that list.
Two exceptions to "only those given": a DeepSeek-V3 built from flags gets Megatron's default score function
(softmax; transformers' DeepSeek-V3 scores with sigmoid), and MindSpeed's `pai_megatron_aux_loss` is mapped to
what it computes (`pai_aux_loss`). MindSpeed's `sqrtsoftplus` scores are the router's own; its `--seq-aux` loss
under balancing 'none' (a loss of its own, not megatron-core's seq_aux_loss) is `mindspeed_seq_aux_loss`.
`a` is `architecture.Arch` (flag values, dispositions, fields).
"""
from __future__ import annotations


from fsdp2_backend.models.registry import specs

# the model types whose transformers model runs as the model id of the same name with this project's router (the
# specs' `router_promoted`, models/<id>/spec.py)
ROUTER_FAMILIES = tuple(t for spec in specs() if spec.router_promoted for t in spec.hf_model_types)
_ROUTER_FIELDS = (("moe_router_score_function", "moe_router_score_function"),
                  ("moe_router_topk_scaling_factor", "moe_router_topk_scaling_factor"),
                  ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
                  ("moe_router_num_groups", "moe_router_num_groups"), ("n_group", "moe_router_num_groups"),
                  ("moe_router_group_topk", "moe_router_group_topk"), ("topk_group", "moe_router_group_topk"),
                  ("moe_z_loss_coeff", "moe_z_loss_coeff"), ("moe_router_dtype", "moe_router_dtype"))


_PAI_IGNORES = ("seq_aux", "moe_router_num_groups", "n_group", "moe_router_group_topk", "topk_group",
                "moe_router_topk_scaling_factor", "routed_scaling_factor")


def pai_aux_loss(a) -> bool:
    """MindSpeed-LLM's `pai_megatron_aux_loss` balancing (`tasks/models/common/pai_megatron.py`): megatron-core's
    `topk_softmax_with_capacity(logits, k, use_pre_softmax=True)` — softmax over all experts, top-k, no
    renormalisation, no groups, no scaling — plus megatron-core's `aux_loss` (`switch_load_balancing_loss_func`
    on the softmax scores). That is `aux_loss` with `--moe-router-pre-softmax`; `--seq-aux` is not read there."""
    balancing = a.get("moe_router_load_balancing_type")
    return "pai_megatron_aux_loss" in (balancing if isinstance(balancing, list) else [balancing])


def megatron_router(a, family: str = "") -> None:
    """Megatron's router flags → `model.moe_router_*` (megatron-core's routing and losses, exactly)."""
    g = a.get
    balancing, coeff = g("moe_router_load_balancing_type"), g("moe_aux_loss_coeff")
    pai = pai_aux_loss(a)
    if pai:
        balancing = [("aux_loss" if b == "pai_megatron_aux_loss" else b) for b in balancing] \
            if isinstance(balancing, list) else "aux_loss"
        a.field("moe_router_load_balancing_type", "model.moe_router_pre_softmax", True)
        for dest in _PAI_IGNORES:
            a.note(dest, "no_effect", "MindSpeed's pai_megatron_aux_loss routing reads no groups, scaling or "
                   "--seq-aux (pre-softmax top-k with megatron-core's aux_loss)")
    if a.from_scratch and family == "deepseek_v3" and not pai:  # the flags are the whole model: Megatron's
        a.field("moe_router_score_function", "model.moe_router_score_function",  # default, not DeepSeek's sigmoid
                g("moe_router_score_function"))
    # MindSpeed's --seq-aux: the sequence-level loss in place of the batch-level one. With balancing 'none' MindSpeed
    # adds a loss of its own (core/transformer/moe/router.py: apply_seq_aux_loss): scores shifted by the expert bias
    # and normalised, per-sequence counts of the selected experts — the router's `mindspeed_seq_aux_loss`
    if g("seq_aux") and not pai:
        seq_kind = {"aux_loss": "seq_aux_loss", "none": "mindspeed_seq_aux_loss"}
        balancing = [seq_kind.get(b, b) for b in balancing] if isinstance(balancing, list) \
            else seq_kind.get(balancing, balancing)
        a.field("seq_aux", "model.moe_router_load_balancing_type", balancing)
    kinds = balancing if isinstance(balancing, list) else [balancing]
    coeffs = coeff if isinstance(coeff, list) else [coeff] * len(kinds)
    if "sinkhorn" in kinds or any(c for k, c in zip(kinds, coeffs) if k.endswith("aux_loss")):
        a.field("moe_router_load_balancing_type", "model.moe_router_load_balancing_type", balancing)
        a.field("moe_aux_loss_coeff", "model.moe_aux_loss_coeff", coeff)
    else:  # Megatron adds no load-balancing loss: nor does the model (transformers' aux loss stays off)
        for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "seq_aux"):
            if not (pai and dest == "seq_aux"):
                a.note(dest, "no_effect", "no load-balancing loss (its coefficient is 0), as in Megatron")
    for dest, target in _ROUTER_FIELDS:  # only those given: Megatron's defaults are the HF model's routing
        if dest in a.active and not (pai and dest in _PAI_IGNORES):
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
        a.decline("seq_aux", "the sequence-level auxiliary loss needs this project's router (a model of "
                  f"{', '.join(ROUTER_FAMILIES)}) — drop --seq-aux")
