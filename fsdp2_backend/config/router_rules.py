"""Config rules of Megatron's MoE router fields (`model.moe_router_*`, `moe_*_loss_coeff`), as megatron-core
checks them, and where the router exists (`fsdp2_backend/models/moe/router.py`: this project's MoE models). Which
id runs which router is each id's spec (`models/<id>/spec.py`: `router`, `router_promoted`, `router_scores_sigmoid`,
`expert_bias`, `group_score_top2`, `renormalises_topk`). Torch-free; called once from `validation`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

from fsdp2_backend.models.registry import spec_for_model_type, spec_of

if TYPE_CHECKING:
    from fsdp2_backend.config.model_facts import ModelFacts
    from fsdp2_backend.config.schema import Config


_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none", "mindspeed_seq_aux_loss")
def megatron_router_set(m) -> bool:
    """True when a `model.moe_router_*` / `moe_*_loss_coeff` field asks for Megatron's router."""
    return any(getattr(m, name) is not None for name in (
        "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_load_balancing_type", "moe_z_loss_coeff",
        "moe_router_dtype")) or m.moe_router_enable_expert_bias


def router_errors(m) -> List[str]:
    """The Megatron router fields (models/moe/router.py), as megatron-core checks them."""
    errors: List[str] = []
    kinds = m.moe_router_load_balancing_type
    kinds = [] if kinds is None else [kinds] if isinstance(kinds, str) else list(kinds)
    for kind in kinds:
        if kind not in _BALANCING:
            errors.append(f"model.moe_router_load_balancing_type: '{kind}' is not one of {', '.join(_BALANCING)}")
    coeffs = m.moe_aux_loss_coeff
    if isinstance(coeffs, (list, tuple)) and len(coeffs) != len(kinds):
        errors.append(f"model.moe_aux_loss_coeff: {len(coeffs)} coefficients for {len(kinds)} load-balancing types "
                      f"— give one per type")
    if "sinkhorn" in kinds and any(c for c in (coeffs if isinstance(coeffs, (list, tuple)) else [coeffs])):
        errors.append("model.moe_aux_loss_coeff: Sinkhorn routing takes no aux loss (megatron-core asserts it) — "
                      "set it to 0")
    if (m.moe_router_num_groups is None) != (m.moe_router_group_topk is None):
        errors.append("model.moe_router_num_groups / model.moe_router_group_topk: group-limited routing needs both")
    if "mindspeed_seq_aux_loss" in kinds and ("aux_loss" in kinds or "sinkhorn" in kinds):
        errors.append("model.moe_router_load_balancing_type: mindspeed_seq_aux_loss (MindSpeed's --seq-aux under "
                      "balancing 'none') goes with neither aux_loss (both log as load_balancing_loss) nor sinkhorn "
                      "— keep one of them")
    spec = spec_of(m.model_id)
    if m.moe_router_enable_expert_bias and m.moe_router_score_function not in ("sigmoid", "sqrtsoftplus") and \
            not (spec and spec.router_scores_sigmoid):  # those score with sigmoid by themselves
        errors.append("model.moe_router_enable_expert_bias: the expert bias applies to sigmoid or sqrtsoftplus scores "
                      "(megatron-core and MindSpeed assert it) — set model.moe_router_score_function: sigmoid")
    if m.moe_router_enable_expert_bias and spec and not spec.expert_bias:
        errors.append(spec.note("expert_bias"))
    return errors


def check_router_model(config: "Config", facts: "ModelFacts", errors: List[str]) -> None:
    """Megatron's router lives in this project's MoE models: a transformers model without a model id has none."""
    m = config.model
    own = spec_for_model_type(facts.model_type)  # the id building this model type, when it has the router
    own = own if own is not None and own.router == "megatron" else None
    if megatron_router_set(m) and m.model_id is None and facts.model_type is not None and \
            not (own and own.router_promoted):  # a promoted type runs as its id by itself (validation.normalise)
        model_id = own and own.model_id
        errors.append(f"model.moe_router_*: Megatron's router options need this project's model implementation — "
                      + (f"set model.model_id {model_id} for this {facts.model_type} model, or drop them" if model_id
                         else f"no model id here implements {facts.model_type}'s MoE; drop them"))
    norm = (m.architecture or {}).get("norm_topk_prob", (facts.config_json or {}).get("norm_topk_prob"))
    typed = spec_for_model_type(facts.model_type)
    swapped = (typed is not None and m.model_id == typed.model_id) or megatron_router_set(m) or \
        config.parallel.ep_size > 1 or config.optimization.moe_grouped_gemm or config.optimization.fix_router
    if typed and typed.renormalises_topk and norm is False and swapped and m.moe_router_score_function != "softmax":
        errors.append(f"model.model_id {typed.model_id}: this {typed.name} config has norm_topk_prob false, and "
                      "Megatron's sigmoid router (models/moe/family_swap.py) always renormalises the top-k — set "
                      "model.moe_router_score_function softmax, or run transformers' model (no router options, EP, "
                      "grouped GEMM or fix_router)")


def group_score_notices(config: "Config", facts: "ModelFacts") -> List[str]:
    """One line where transformers' group score (the top 2 of a group) and megatron-core's (the top k / group_topk)
    differ for this model: which one the run takes."""
    m = config.model
    # transformers defines the routers of these ids' model types with group-limited selection, scoring a group by
    # the sum of its top 2 (DeepseekV3TopkRouter, GlmMoeDsaTopkRouter; models/moe/family_swap.py: HF_GROUP_SCORE_TOPK)
    spec = spec_for_model_type(facts.model_type)
    if spec is None or not spec.group_score_top2 or m.model_id != spec.model_id:
        return []
    known = (spec.model_id, spec.name)
    hf = {**(facts.config_json or {}), **(m.architecture or {})}
    megatron = m.moe_router_num_groups is not None or m.moe_router_group_topk is not None
    groups = m.moe_router_num_groups if m.moe_router_num_groups is not None else hf.get("n_group") or 1
    group_topk = m.moe_router_group_topk if m.moe_router_group_topk is not None else hf.get("topk_group") or 1
    top_k = hf.get("num_experts_per_tok")
    if groups <= 1 or not top_k or top_k // group_topk == 2:
        return []
    if megatron:
        return [f"model.moe_router_num_groups / moe_router_group_topk (Megatron's --moe-router-num-groups / "
                f"--moe-router-group-topk): each expert group is scored by the sum of its top {top_k // group_topk} "
                f"scores (top-k {top_k} / {group_topk} groups, megatron-core's rule); transformers' {known[1]} sums "
                f"its top 2, so the routing differs from transformers' model"]
    return [f"model.model_id {m.model_id}: group-limited routing ({groups} groups, {group_topk} chosen) scores each "
            f"group by the sum of its top 2 scores, as transformers' {known[1]} defines it; megatron-core's rule "
            f"would sum the top {top_k // group_topk} (top-k {top_k} / {group_topk}) — set "
            f"model.moe_router_num_groups and moe_router_group_topk (--moe-router-num-groups / "
            f"--moe-router-group-topk) for Megatron's"]
