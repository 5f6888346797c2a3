"""The `deepseek_v3`, `mixtral`, `qwen2_moe` and `glm52` (transformers' `glm_moe_dsa`) model ids: transformers' model of that family with stacked
experts and this project's router (Megatron's router options), by one swap applied to every sparse block.

As `models/qwen3_moe/modeling.py` does for Qwen3-MoE, each family's model is transformers' own causal LM (attention,
norms, rotary, shared experts and their gate, the aux-loss bookkeeping, `_init_weights`) with, in every sparse
block:
- `experts` → `GroupedExperts` (transformers' in-memory layout: `gate_up_proj` (E, 2I, H), `down_proj`
  (E, H, I)), open to expert parallelism and the grouped GEMM;
- `gate` → a `TopKRouter` (`models.moe.router`) that is also transformers' router class of the family (its
  `router_logits` recorder hooks that class). Its defaults are the family's routing in transformers:
  Mixtral softmax, top-k, renormalised; Qwen2-MoE softmax, renormalised when `norm_topk_prob` (else
  pre-softmax); DeepSeek-V3 sigmoid scores in fp32, selection on `scores + e_score_correction_bias`,
  group-limited (`n_group` / `topk_group`) when n_group > 1, renormalised, times `routed_scaling_factor`.
  The `model.moe_router_*` fields (Megatron's flags) override them. DeepSeek-V3's `e_score_correction_bias`
  stays the router's buffer under transformers' name (checkpoints, exports); it is Megatron's expert bias:
  with `moe_router_enable_expert_bias` it is updated after each step from the global token counts.
- the block's forward → the same computation, handing the router the (batch, seq, hidden) input so that the
  sequence-level aux loss can tell the sequences apart.

Group-limited selection follows the model: a group is scored by the sum of its top 2 scores, as transformers'
DeepSeek-V3 and GLM-MoE-DSA do, unless Megatron's group flags (`model.moe_router_num_groups` / `group_topk`,
--moe-router-num-groups / --moe-router-group-topk) ask for megatron-core's rule, the top (k / group_topk); the two
agree for DeepSeek-V2/V3's own configs (k 6 / 3 groups, 8 / 4), and config validation says once which one a run
takes where they differ (`config.rules.model.group_score_notices`). Difference from transformers, on purpose:
Megatron's sigmoid routing always renormalises the top-k (a DeepSeek-V3 config with `norm_topk_prob: false` is
refused by config validation, `config.rules.model`, unless softmax scores are asked for).

Per-expert checkpoint keys: DeepSeek-V3 and Qwen2-MoE hold `mlp.experts.{e}.gate_proj/up_proj/down_proj`
(qwen3_moe's layout, same functions), Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2` (MiniMax-M2's layout).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm
from transformers.models.mixtral import modeling_mixtral as mx
from transformers.models.qwen2_moe import modeling_qwen2_moe as q2

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.grouped_causal_lm import GroupedMoECausalLM
from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter


# -- routers: the project's router, recognised by transformers as the family's own ------------------------------
class _FamilyRouter(TopKRouter):
    """`TopKRouter` built from the HF config with the family's routing (`defaults`), with transformers' router
    signature (hidden states in; logits, weights, index out)."""

    def __init__(self, config):
        settings = self.defaults(config)
        TopKRouter.__init__(self, replace(settings, expert_bias=False), config.hidden_size)
        self._setup(config)
        self.apply_settings(settings)

    def _setup(self, config) -> None:
        """Registers the family's own router buffers (before the settings)."""

    def selection_bias(self):
        return None

    def forward(self, hidden_states: torch.Tensor):
        batch = hidden_states.shape[0] if hidden_states.dim() == 3 else 1
        logits = self.gating(hidden_states.reshape(-1, self.hidden_dim))
        weights, index = self.route(logits, batch, selection_bias=self.selection_bias())
        return logits, weights, index


class MixtralRouter(_FamilyRouter, mx.MixtralTopKRouter):
    """Mixtral's routing (softmax, top-k, renormalised) with Megatron's options."""

    @staticmethod
    def defaults(config) -> RouterSettings:
        return RouterSettings.from_hf(config)


class Qwen2MoeRouter(_FamilyRouter, q2.Qwen2MoeTopKRouter):
    """Qwen2-MoE's routing (softmax; renormalised top-k when `norm_topk_prob`) with Megatron's options."""

    @staticmethod
    def defaults(config) -> RouterSettings:
        return RouterSettings.from_hf(config)


# transformers' DeepSeek-V3 and GLM-MoE-DSA routers score an expert group by the sum of its top 2 scores, whatever
# k and topk_group are (megatron-core: the top k / topk_group).
HF_GROUP_SCORE_TOPK = 2


class DeepseekV3Router(_FamilyRouter, ds.DeepseekV3TopkRouter):
    """DeepSeek-V3's routing with Megatron's options; `e_score_correction_bias` (the checkpoint's, fp32) selects
    with sigmoid (or MindSpeed's sqrtsoftplus) scores and is Megatron's `expert_bias` when the run updates it."""

    @staticmethod
    def defaults(config) -> RouterSettings:
        groups = config.n_group if (config.n_group or 1) > 1 else None
        return RouterSettings.from_hf(config, score_function="sigmoid", dtype="fp32", num_groups=groups,
                                      group_topk=config.topk_group if groups else None,
                                      group_score_topk=HF_GROUP_SCORE_TOPK if groups else None,
                                      scaling_factor=config.routed_scaling_factor)

    def _setup(self, config) -> None:
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    @property
    def expert_bias(self):  # Megatron's expert bias is the checkpoint's correction bias (updated only when asked)
        return self.e_score_correction_bias if self.settings.expert_bias else None

    def selection_bias(self):
        return self.e_score_correction_bias if self.settings.score_function in ("sigmoid", "sqrtsoftplus") else None


class GlmMoeDsaRouter(DeepseekV3Router, glm.GlmMoeDsaTopkRouter):
    """GLM-5.2's routing (`glm52` model id): DeepSeek-V3's (sigmoid, correction bias, groups, scaling)."""


# -- blocks: transformers' computation, the router given (batch, seq, hidden) ----------------------------------------
class MixtralGroupedBlock(mx.MixtralSparseMoeBlock):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        _, weights, index = self.gate(hidden_states)
        return self.experts(hidden_states.reshape(-1, h), index, weights).reshape(b, s, h)


class Qwen2MoeGroupedBlock(q2.Qwen2MoeSparseMoeBlock):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        _, weights, index = self.gate(hidden_states)
        return (self.experts(flat, index, weights) + shared).reshape(b, s, h)


class DeepseekV3GroupedBlock(ds.DeepseekV3MoE):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        _, weights, index = self.gate(hidden_states)
        out = self.experts(hidden_states.reshape(-1, h), index, weights).reshape(b, s, h)
        return out + self.shared_experts(hidden_states)


class GlmMoeDsaGroupedBlock(glm.GlmMoeDsaMoE):
    forward = DeepseekV3GroupedBlock.forward


@dataclass(frozen=True)
class Family:
    """One transformers MoE family: its classes and the project's replacements."""

    causal_lm: type
    block: type
    experts: type
    grouped_block: type
    router: type
    num_experts: Callable[[object], int]


FAMILIES: Mapping[str, Family] = {
    "mixtral": Family(mx.MixtralForCausalLM, mx.MixtralSparseMoeBlock, mx.MixtralExperts, MixtralGroupedBlock,
                      MixtralRouter, lambda c: c.num_local_experts),
    "qwen2_moe": Family(q2.Qwen2MoeForCausalLM, q2.Qwen2MoeSparseMoeBlock, q2.Qwen2MoeExperts,
                        Qwen2MoeGroupedBlock, Qwen2MoeRouter, lambda c: c.num_experts),
    "deepseek_v3": Family(ds.DeepseekV3ForCausalLM, ds.DeepseekV3MoE, ds.DeepseekV3Experts,
                          DeepseekV3GroupedBlock, DeepseekV3Router, lambda c: c.n_routed_experts),
    # GLM-5.2 (model id glm52): DeepSeek-V3's MoE under DeepSeek sparse attention (its indexer trained by
    # training.indexer_loss_coeff: models/dsa_indexer_loss.py, hooked in by models/moe/hooks.py)
    "glm_moe_dsa": Family(glm.GlmMoeDsaForCausalLM, glm.GlmMoeDsaMoE, glm.GlmMoeDsaExperts, GlmMoeDsaGroupedBlock,
                          GlmMoeDsaRouter, lambda c: c.n_routed_experts),
}


def grouped_experts(hf_experts: nn.Module) -> GroupedExperts:
    """`GroupedExperts` holding transformers' stacked expert parameters themselves (same names and shapes)."""
    num_experts, two_inter, hidden = hf_experts.gate_up_proj.shape
    with torch.device("meta"):  # the parameters are replaced by the HF module's own below
        experts = GroupedExperts(num_experts, hidden, two_inter // 2, hf_experts.act_fn)
    experts.gate_up_proj, experts.down_proj = hf_experts.gate_up_proj, hf_experts.down_proj
    return experts


def swap_router(router_cls: type, config, hf_router: nn.Module) -> TopKRouter:
    """A project router holding transformers' router weight and buffers (e.g. the correction bias); its own
    buffers (expert bias, token counts) zeros where the weight lives."""
    with torch.device("meta"):
        router = router_cls(config)
    router.weight = hf_router.weight
    for name, buf in list(router.named_buffers()):
        own = getattr(hf_router, name, None)
        setattr(router, name, own if isinstance(own, torch.Tensor) else
                torch.zeros_like(buf, device=router.weight.device))
    return router


def swap_blocks(model: nn.Module, family: Family, config=None) -> None:
    """Every sparse block of `model` (a causal LM, or one layer of it with the model's `config`, e.g. an MTP
    layer): stacked experts, the project's router, the grouped block's forward."""
    config = model.config if config is None else config
    for module in list(model.modules()):
        if type(module) is family.block:
            module.experts = grouped_experts(module.experts)
            module.gate = swap_router(family.router, config, module.gate)
            module.__class__ = family.grouped_block


def _grouped_class(model_type: str) -> type:
    family = FAMILIES[model_type]

    def __init__(self, config):
        family.causal_lm.__init__(self, config)
        swap_blocks(self, family)
        if not hasattr(config, "router_aux_loss_coef"):  # DeepSeek-V3 has no aux loss of its own: Megatron's
            self.router_aux_loss_coef = 1.0               # losses come weighted (trainers read this coefficient)
            config.router_aux_loss_coef = 1.0

    name = family.causal_lm.__name__.replace("ForCausalLM", "GroupedForCausalLM")
    return type(name, (GroupedMoECausalLM, family.causal_lm),
                {"__init__": __init__, "_family": family, "hf_experts_class": family.experts,
                 "hf_class": family.causal_lm,
                 # Mixtral's HF checkpoints (and configs written for them) name the sparse block block_sparse_moe
                 "plan_path_aliases": {"block_sparse_moe": "mlp"} if model_type == "mixtral" else {}})


GROUPED_CLASSES: Dict[str, type] = {model_type: _grouped_class(model_type) for model_type in FAMILIES}


def build(hf_config) -> nn.Module:
    """The registry builder for `hf_config.model_type` (deepseek_v3, mixtral, qwen2_moe, glm_moe_dsa)."""
    return GROUPED_CLASSES[hf_config.model_type](hf_config)
