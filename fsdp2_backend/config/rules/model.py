"""Rules of the `model.*` fields: Megatron's MoE router fields, MindSpeed's MLA latent scales, quantised training.
Torch-free; called once from `validation`; its parts, in order:

Config rules of Megatron's MoE router fields (`model.moe_router_*`, `moe_*_loss_coeff`), as megatron-core
checks them, and where the router exists (`fsdp2_backend/models/moe/router.py`: this project's MoE models). Which
id runs which router is each id's spec (`models/<id>/spec.py`: `router`, `router_promoted`, `router_scores_sigmoid`,
`expert_bias`, `group_score_top2`, `renormalises_topk`). Torch-free; called once from `validation`.

Validation of MindSpeed's MLA latent scales (`model.mla_scale_q_lora` / `mla_scale_kv_lora`; models/mla_lora_scale.py),
torch-free: the model must have multi-latent attention, and the query factor a query latent (MindSpeed divides
hidden_size by q_lora_rank). Checked from the model's config (HF directory, checkpoint or architecture flags)
before any process group; a model whose config is not known here is checked again when it is built.

The config rules of quantised training (`model.quant_*`, low-precision all-gather), torch-free.

`check_quantization` appends errors: the quant fields without a recipe; unknown converter names (listing the
known ones); torchao missing; layouts the MXFP8 weights do not support yet (tensor and expert parallel); FP8
recipes under context parallel (tensor parallel takes their scales over the tp ranks: `parallel/float8_tp.py`).
`quant_notices` lists fields with no effect in the chosen mode (reported once).
"""
from __future__ import annotations

import importlib.util
from typing import Any, List, TYPE_CHECKING

from fsdp2_backend.models.registry import spec_for_model_type, spec_of
from fsdp2_backend.config.schema import Config
from fsdp2_backend.config.quant_names import (CONVERTERS, EXPERTS_CONVERTER, FLOAT8_LINEAR_CONVERTER,
                                             FLOAT8_RECIPES, MX_CONVERTERS)

if TYPE_CHECKING:
    from fsdp2_backend.config.model_facts import ModelFacts


# --- router ----------------------------------------------------------------------------------------

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


# --- mla -------------------------------------------------------------------------------------------

def mla_scale_errors(config: Any, facts: Any) -> List[str]:
    m = config.model
    if not (m.mla_scale_q_lora or m.mla_scale_kv_lora):
        return []
    values = dict(getattr(facts, "config_json", None) or {})
    values.update(m.architecture or {})
    if not values:
        return []
    field = "model.mla_scale_q_lora" if m.mla_scale_q_lora else "model.mla_scale_kv_lora"
    if not values.get("kv_lora_rank"):
        return [f"{field}: the model ({values.get('model_type', 'unknown type')}) has no multi-latent attention "
                f"(no kv_lora_rank) — drop the flag (--enable-mla-scale-*), or train an MLA model"]
    if m.mla_scale_q_lora and not values.get("q_lora_rank"):
        return ["model.mla_scale_q_lora: the model's multi-latent attention has no query latent (q_lora_rank "
                "unset), so there is nothing to scale — drop --enable-mla-scale-q-lora"]
    return []


# --- quant -----------------------------------------------------------------------------------------

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
