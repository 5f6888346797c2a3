"""Config rules of Megatron's MoE router fields (`model.moe_router_*`, `moe_*_loss_coeff`), as megatron-core
checks them, and where the router exists (`fsdp2_backend/models/moe/router.py`: this project's MoE models). Torch-free;
called once from `validation`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from fsdp2_backend.config.model_facts import ModelFacts
    from fsdp2_backend.config.schema import Config


_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none", "mindspeed_seq_aux_loss")
# HF model types whose model id (the same name) is transformers' model with this project's router and stacked
# experts (models/qwen3_moe/modeling.py, models/moe/family_swap.py): selected by normalise() when a run asks for them.
ROUTER_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe")


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
    if m.moe_router_enable_expert_bias and m.moe_router_score_function not in ("sigmoid", "sqrtsoftplus") and \
            m.model_id not in ("minimax_m27", "step35"):  # those score with sigmoid by themselves
        errors.append("model.moe_router_enable_expert_bias: the expert bias applies to sigmoid or sqrtsoftplus scores "
                      "(megatron-core and MindSpeed assert it) — set model.moe_router_score_function: sigmoid")
    if m.moe_router_enable_expert_bias and m.model_id == "step35":
        errors.append("model.moe_router_enable_expert_bias (--moe-router-enable-expert-bias): model_id step35 "
                      "selects experts with the checkpoint's moe.router_bias, which this project does not update "
                      "— drop the flag")
    return errors


# The model ids whose MoE blocks carry the project's router, by the HF model type they build (besides
# ROUTER_MODEL_TYPES, promoted automatically).
_MODEL_IDS_BY_TYPE = {"minimax_m2": "minimax_m27", "gpt_oss": "gpt_oss", "step3p5": "step35",
                      "qwen3_next": "qwen3_next"}


def check_router_model(config: "Config", facts: "ModelFacts", errors: List[str]) -> None:
    """Megatron's router lives in this project's MoE models: a transformers model without a model id has none."""
    m = config.model
    if megatron_router_set(m) and m.model_id is None and facts.model_type not in (None,) + ROUTER_MODEL_TYPES:
        model_id = _MODEL_IDS_BY_TYPE.get(facts.model_type)
        errors.append(f"model.moe_router_*: Megatron's router options need this project's model implementation — "
                      + (f"set model.model_id {model_id} for this {facts.model_type} model, or drop them" if model_id
                         else f"no model id here implements {facts.model_type}'s MoE; drop them"))
    norm = (m.architecture or {}).get("norm_topk_prob", (facts.config_json or {}).get("norm_topk_prob"))
    swapped = m.model_id == "deepseek_v3" or megatron_router_set(m) or config.parallel.ep_size > 1 or \
        config.optimization.moe_grouped_gemm or config.optimization.fix_router
    if facts.model_type == "deepseek_v3" and norm is False and swapped and m.moe_router_score_function != "softmax":
        errors.append("model.model_id deepseek_v3: this DeepSeek-V3 config has norm_topk_prob false, and Megatron's "
                      "sigmoid router (models/moe/family_swap.py) always renormalises the top-k — set "
                      "model.moe_router_score_function softmax, or run transformers' model (no router options, EP, "
                      "grouped GEMM or fix_router)")


# HF model types whose routers transformers defines with group-limited selection, scoring a group by the sum of its
# top 2 scores (DeepseekV3TopkRouter, GlmMoeDsaTopkRouter), and the model ids that run them with this project's
# router (models/moe/family_swap.py: HF_GROUP_SCORE_TOPK).
_HF_GROUP_SCORE = {"deepseek_v3": ("deepseek_v3", "DeepSeek-V3"), "glm_moe_dsa": ("glm52", "GLM-MoE-DSA")}


def group_score_notices(config: "Config", facts: "ModelFacts") -> List[str]:
    """One line where transformers' group score (the top 2 of a group) and megatron-core's (the top k / group_topk)
    differ for this model: which one the run takes."""
    m = config.model
    known = _HF_GROUP_SCORE.get(facts.model_type)
    if known is None or m.model_id != known[0]:
        return []
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
