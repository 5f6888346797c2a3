"""The `deepseek_v4` model id (MindSpeed-LLM's DeepSeek-V4-Flash): transformers' `DeepseekV4ForCausalLM`
(hyper-connections (mHC), compressed sparse attention with its lightning indexer, sliding window, sinks, hash
routing in the first layers) with its experts stacked as this project's `GroupedExperts`, so that expert
parallelism, the grouped GEMM and the expert FSDP apply to them.

- Experts: DeepSeek-V4's clamped SwiGLU (gate ≤ swiglu_limit, |up| ≤ swiglu_limit) between the two GEMMs, as
  transformers' `_apply_gate` (MindSpeed's `use_triton_swiglu_limit` is a Triton-Ascend kernel of the same math).
- Routers: transformers' own (sqrt-softplus scores with the checkpoint's correction bias; the hash router's
  frozen token→expert table): Megatron's router options are not applied to this model (config validation says so).
- Checkpoints: DeepSeek's own key layout (`attn.wq_a`, `ffn.experts.{e}.w1`, `head.weight`), read through
  transformers' conversion (models/hf_layout.py); the export is transformers' save of its own class.
- MTP: transformers' class drops DeepSeek-V4's MTP layers; with `model.mtp_num_layers` (--mtp-num-layers) this id
  builds them (DeepSeek's MTPBlock over the mHC streams, models/deepseek_v4/mtp.py), loads the checkpoint's `mtp.*`
  keys, trains them with the MTP loss (mtp_loss_scaling_factor) and exports them under DeepSeek's `mtp.{k}.*` names;
  unset, one line says the config's MTP layers are not built.
- The indexer: with `training.indexer_loss_coeff` > 0 it is trained by MindSpeed's KL loss against the attention
  (models/dsa_indexer_loss.py, hooked in by `configure_deepseek_v4`); else its top-k runs without gradient.
"""
from __future__ import annotations

from typing import List, Mapping

import torch
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dv4

from fsdp2_backend.models import hf_layout
from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.grouped_causal_lm import GroupedMoECausalLM


class ClampedGroupedExperts(GroupedExperts):
    """`GroupedExperts` with DeepSeek-V4's clamped SwiGLU."""

    limit: float = 10.0

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


def _grouped(hf_experts: dv4.DeepseekV4Experts) -> ClampedGroupedExperts:
    num_experts, two_inter, hidden = hf_experts.gate_up_proj.shape
    with torch.device("meta"):  # the parameters are the HF module's own (assigned below)
        experts = ClampedGroupedExperts(num_experts, hidden, two_inter // 2, hf_experts.act_fn)
    experts.gate_up_proj, experts.down_proj = hf_experts.gate_up_proj, hf_experts.down_proj
    experts.limit = hf_experts.limit
    return experts


class DeepseekV4GroupedForCausalLM(GroupedMoECausalLM, dv4.DeepseekV4ForCausalLM):
    """`DeepseekV4ForCausalLM` whose experts are `ClampedGroupedExperts` (same names, shapes and init)."""

    hf_experts_class, hf_class = dv4.DeepseekV4Experts, dv4.DeepseekV4ForCausalLM
    # MindSpeed's YAMLs name an MTP depth's decoder layer `mtp.layers.{*}.layer` (its MultiTokenPredictionLayer);
    # ours is `transformer_layer` (models/mtp.py, Megatron's name): plan patterns take both (parallel/plans.py)
    plan_path_aliases = {"layer": "transformer_layer"}

    @classmethod
    def is_custom_code(cls) -> bool:
        """transformers' own modelling with stacked experts: saved and loaded with transformers' checkpoint
        conversions for its class (a class transformers takes for custom code gets them one level down, where
        DeepSeek's anchored renames write `model.embed.weight`, which nothing loads)."""
        return False

    def __init__(self, config):
        super().__init__(config)
        for module in list(self.modules()):
            if isinstance(module, dv4.DeepseekV4SparseMoeBlock):
                module.experts = _grouped(module.experts)


def build_deepseek_v4(hf_config) -> DeepseekV4GroupedForCausalLM:
    """The registry builder."""
    return DeepseekV4GroupedForCausalLM(hf_config)


def checkpoint_keys(name: str, hf_config) -> List[str]:
    return hf_layout.checkpoint_keys(name, hf_config, dv4.DeepseekV4ForCausalLM)


def param_from_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    return hf_layout.param_from_checkpoint(name, tensors, hf_config, dv4.DeepseekV4ForCausalLM)


def _fixed_routing(router: nn.Module, args, output):
    """`optimization.fix_router` (MindSpeed's performance tuning; it changes results): the balanced assignment
    replaces the router's choice, weighted by the router's own normalised, scaled scores of those experts."""
    from fsdp2_backend.models.moe.routing import balanced_assignment

    logits = output[0]
    index = balanced_assignment(logits.shape[0], router.top_k, router.num_experts, logits.device)
    weights = router.score_fn(logits).gather(1, index)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, index


def configure_deepseek_v4(model: nn.Module, config) -> None:
    """The run's MoE switches (the grouped GEMM on every expert module, fix_router on every router), the
    indexer KL loss, and one line when the config declares MTP layers this run does not build."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_gemm = config.optimization.moe_grouped_gemm
        if config.optimization.fix_router and isinstance(module, (dv4.DeepseekV4TopKRouter, dv4.DeepseekV4HashRouter)):
            module.register_forward_hook(_fixed_routing)
    if config.training.indexer_loss_coeff:  # MindSpeed's DSA indexer KL loss (training only)
        from fsdp2_backend.models.dsa_indexer_loss import install_deepseek_v4

        install_deepseek_v4(model, config.training.indexer_loss_coeff)
    mtp = getattr(model.config, "num_nextn_predict_layers", 0) or 0
    if mtp and not config.model.mtp_num_layers:  # with it: models/deepseek_v4/mtp.py builds and loads them
        from fsdp2_backend.distributed.console import print_rank0

        print_rank0(f"model_id deepseek_v4: the config's {mtp} MTP layers (num_nextn_predict_layers; checkpoint keys "
                    f"mtp.*) are not built — set model.mtp_num_layers (--mtp-num-layers) to train them")
