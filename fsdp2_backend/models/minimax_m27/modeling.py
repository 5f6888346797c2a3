"""The `minimax_m27` model id: transformers' MiniMax-M2 (MiniMax-M2.7) with grouped-GEMM experts and the
project's router.

The model is transformers' `MiniMaxM2ForCausalLM` (full attention with q/k RMSNorm over the whole projection,
partial RoPE, norms, `_init_weights`, the aux-loss bookkeeping) with two swaps in every sparse block:
- `mlp.experts` → `GroupedExperts` (transformers' in-memory layout: `gate_up_proj` (E, 2I, H), `down_proj`
  (E, H, I));
- `mlp.gate` → `MiniMaxM2Router` (`models.moe.router`): sigmoid scores, experts selected on
  `scores + e_score_correction_bias`, the unbiased scores of the k renormalised — Megatron's sigmoid routing
  with an expert bias. The bias stays the block's buffer `mlp.e_score_correction_bias` (transformers' name, so
  `from_pretrained` / `save_pretrained` and exports keep it): read from the checkpoint, used for selection only
  and updated only with Megatron's aux-loss-free bias update (`moe_router_enable_expert_bias`, see
  `configure_minimax`).

On disk MiniMax-M2 checkpoints hold `block_sparse_moe.*` keys with one tensor per expert
(`block_sparse_moe.experts.{e}.w1/w3/w2.weight`, `block_sparse_moe.gate.weight`,
`block_sparse_moe.e_score_correction_bias`) — transformers 5 renames and stacks them in `from_pretrained`
(its conversion mapping "minimax_m2" = mixtral's + the bias) and reverses that in `save_pretrained`.
`checkpoint_keys` / `param_from_checkpoint` do the same one tensor at a time for the streaming loader (also
for transformers' own class, `model_id` unset). Released checkpoints are FP8 block-quantised; the loader
dequantises those keys (`models.fp8_blocks`) before they reach `param_from_checkpoint`.
"""
from __future__ import annotations

import re
import weakref
from typing import List, Mapping, Optional

import torch
from torch import nn
from transformers.models.minimax_m2.modeling_minimax_m2 import (MiniMaxM2Experts, MiniMaxM2ForCausalLM,
                                                                MiniMaxM2SparseMoeBlock, MiniMaxM2TopKRouter)

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.grouped_causal_lm import GroupedMoECausalLM
from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe

_STACKED = re.compile(r"^(?P<layer>.*)\.mlp\.experts\.(?P<name>gate_up_proj|down_proj)$")
_BLOCK = re.compile(r"^(?P<layer>.*)\.mlp\.(?P<rest>gate\.weight|e_score_correction_bias)$")


class MiniMaxM2Router(TopKRouter, MiniMaxM2TopKRouter):
    """MiniMax-M2's routing as the project's router (Megatron's options, `fix_router`), recognised by
    transformers as its MiniMax-M2 router (its `router_logits` recorder hooks that class)."""

    def __init__(self, config):
        TopKRouter.__init__(self, RouterSettings.from_hf(config, score_function="sigmoid"), config.hidden_size)

    @property
    def expert_bias(self) -> Optional[torch.Tensor]:
        """With Megatron's expert-bias update (`moe_router_enable_expert_bias`), the bias it moves is the block's
        own `e_score_correction_bias` (the one that selects experts, saved and exported under transformers' name);
        read live from the block, so a buffer the block replaces (a device move) is still the one updated."""
        block = self.__dict__.get("_block")
        if not getattr(self, "settings", None) or not self.settings.expert_bias or block is None or block() is None:
            return None
        return block().e_score_correction_bias

    def forward(self, hidden_states: torch.Tensor, e_score_correction_bias: torch.Tensor):
        """transformers' signature: the block hands its correction bias, used to select experts only."""
        batch = hidden_states.shape[0] if hidden_states.dim() == 3 else 1
        logits = self.gating(hidden_states.reshape(-1, self.hidden_dim))
        weights, index = self.route(logits, batch, selection_bias=e_score_correction_bias)
        return logits, weights, index


class MiniMaxM2GroupedBlock(MiniMaxM2SparseMoeBlock):
    """transformers' sparse block, handing the router the (batch, seq, hidden) input (sequence-level aux
    loss) and the block's `e_score_correction_bias`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        _, weights, index = self.gate(hidden_states, self.e_score_correction_bias)
        out = self.experts(hidden_states.reshape(-1, hidden_dim), index, weights)
        return out.reshape(batch_size, sequence_length, hidden_dim)


def _swap(config, block: MiniMaxM2SparseMoeBlock) -> None:
    with torch.device("meta"):  # the parameters are replaced by the HF module's own below
        experts = GroupedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                 block.experts.act_fn)
        router = MiniMaxM2Router(config)
    experts.gate_up_proj, experts.down_proj = block.experts.gate_up_proj, block.experts.down_proj
    router.weight = block.gate.weight
    for name, buf in router.named_buffers():
        setattr(router, name, torch.zeros_like(buf, device=router.weight.device))
    block.experts, block.gate = experts, router
    router.__dict__["_block"] = weakref.ref(block)  # not a submodule: the bias owner (MiniMaxM2Router.expert_bias)
    block.__class__ = MiniMaxM2GroupedBlock


class MiniMaxM2GroupedForCausalLM(GroupedMoECausalLM, MiniMaxM2ForCausalLM):
    """`MiniMaxM2ForCausalLM` whose sparse blocks use `GroupedExperts` and `MiniMaxM2Router` (same weights);
    transformers' init, save (its per-expert on-disk layout) and aux loss through `GroupedMoECausalLM`."""

    hf_experts_class, hf_class = MiniMaxM2Experts, MiniMaxM2ForCausalLM
    # MindSpeed-LLM f88dd26d's YAMLs name the sparse block as the checkpoint does (parallel/plans.py)
    plan_path_aliases = {"block_sparse_moe": "mlp"}

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            _swap(config, layer.mlp)


def build_minimax_m2(hf_config) -> MiniMaxM2GroupedForCausalLM:
    """The registry builder."""
    return MiniMaxM2GroupedForCausalLM(hf_config)


def configure_minimax(model: nn.Module, config) -> None:
    """The run's MoE switches and Megatron router fields (`qwen3_moe.configure_moe`). With Megatron's expert-bias
    update (`moe_router_enable_expert_bias`, as MindSpeed-LLM's MiniMax-M2.7 script sets it) the bias moved after
    every step is the checkpoint's `e_score_correction_bias` (`MiniMaxM2Router.expert_bias`); without it that bias
    selects experts and is never updated."""
    configure_moe(model, moe_grouped_gemm=config.optimization.moe_grouped_gemm,
                  fix_router=config.optimization.fix_router, model_args=config.model)


def checkpoint_keys(param_name: str, hf_config) -> List[str]:
    """The MiniMax-M2 checkpoint keys holding `param_name` (a parameter or persistent buffer of transformers'
    in-memory layout)."""
    match = _STACKED.match(param_name)
    if match:
        experts = f"{match['layer']}.block_sparse_moe.experts"
        names = ("w1", "w3") if match["name"] == "gate_up_proj" else ("w2",)
        return [f"{experts}.{e}.{w}.weight" for w in names for e in range(hf_config.num_local_experts)]
    match = _BLOCK.match(param_name)
    if match:
        return [f"{match['layer']}.block_sparse_moe.{match['rest']}"]
    return [param_name]


def param_from_checkpoint(param_name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    """The full tensor from its (already dequantised) checkpoint tensors: w1 / w3 stacked as gate rows then up
    rows, as transformers' conversion does (MergeModulelist + Concatenate)."""
    keys = checkpoint_keys(param_name, hf_config)
    if len(keys) == 1:
        return tensors[keys[0]]
    stacked = torch.stack([tensors[k] for k in keys])
    if _STACKED.match(param_name)["name"] == "down_proj":
        return stacked
    gate, up = stacked.split(hf_config.num_local_experts)
    return torch.cat([gate, up], dim=1)
