"""The `qwen3_moe` model id: transformers' Qwen3-MoE with grouped-GEMM experts and a fixable router.

The model is transformers' `Qwen3MoeForCausalLM` (attention, norms, rotary, the aux-loss bookkeeping and
`_init_weights` are transformers' own) with two swaps in every sparse block:
- `mlp.experts` → `GroupedExperts` (stacked weights, same names and shapes as transformers' in-memory
  `Qwen3MoeExperts`: `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)), computed by a grouped GEMM and open
  to an expert-parallel dispatcher;
- `mlp.gate` → `Qwen3MoeRouter`, transformers' top-k router (softmax, top-k, `norm_topk_prob`
  renormalisation) plus `fix_router`.
State dicts therefore equal transformers' in-memory ones, and transformers' `from_pretrained` /
`save_pretrained` convert to and from the on-disk layout, which holds one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`). Outside transformers, `checkpoint_keys` /
`param_from_checkpoint` / `param_to_checkpoint` convert one parameter at a time (for streaming loaders and
exporters), `to_hf_checkpoint` / `from_hf_checkpoint` whole state dicts.

The auxiliary load-balancing loss is transformers': with the config's `output_router_logits` (the Megatron
translation sets it from --moe-aux-loss-coeff) `outputs.aux_loss` holds it unscaled and `outputs.loss`, when labels are given,
already includes `router_aux_loss_coef * aux_loss`. A trainer that computes its own loss adds
`model.router_aux_loss_coef * outputs.aux_loss`.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeExperts, Qwen3MoeForCausalLM,
                                                              Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter)

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.routing import balanced_assignment

_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<name>gate_proj|up_proj|down_proj)"
                         r"\.weight$")


class Qwen3MoeRouter(Qwen3MoeTopKRouter):
    """transformers' Qwen3-MoE top-k router; with `fixed` (fix_router) the experts come from
    `balanced_assignment` instead of the top-k — balanced load for performance tuning, different results.
    The weights of the fixed experts are still the router's softmax probabilities (renormalised when
    `norm_topk_prob`), so the router keeps receiving gradients."""

    def __init__(self, config, fixed: bool = False):
        super().__init__(config)
        self.fixed = fixed

    def forward(self, hidden_states):
        if not self.fixed:
            return super().forward(hidden_states)
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
        index = balanced_assignment(probs.shape[0], self.top_k, self.num_experts, device=probs.device)
        scores = probs.gather(1, index)
        if self.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return router_logits, scores.to(router_logits.dtype), index


def _grouped_experts(config, hf_experts: Qwen3MoeExperts) -> GroupedExperts:
    with torch.device("meta"):  # the parameters are replaced by the HF module's own below
        experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                 hf_experts.act_fn)
    experts.gate_up_proj, experts.down_proj = hf_experts.gate_up_proj, hf_experts.down_proj
    return experts


def _router(config, hf_router: Qwen3MoeTopKRouter) -> Qwen3MoeRouter:
    with torch.device("meta"):
        router = Qwen3MoeRouter(config)
    router.weight = hf_router.weight
    return router


class Qwen3MoeGroupedForCausalLM(Qwen3MoeForCausalLM):
    """`Qwen3MoeForCausalLM` whose sparse blocks use `GroupedExperts` and `Qwen3MoeRouter` (same weights)."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                layer.mlp.experts = _grouped_experts(config, layer.mlp.experts)
                layer.mlp.gate = _router(config, layer.mlp.gate)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GroupedExperts):  # as transformers initialises its Qwen3MoeExperts
            from transformers import initialization as init

            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """transformers' save (it writes the per-expert layout), naming transformers' own class in config.json
        so that any HF loader builds the stock Qwen3-MoE from the export."""
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            self.config.architectures = [Qwen3MoeForCausalLM.__name__]
            self.config.save_pretrained(save_directory)


def build_qwen3_moe(hf_config) -> Qwen3MoeGroupedForCausalLM:
    """The registry builder: the model for an HF `Qwen3MoeConfig` (the aux loss is on when the config's
    `output_router_logits` is, as in transformers)."""
    return Qwen3MoeGroupedForCausalLM(hf_config)


def configure_moe(model: nn.Module, *, moe_grouped_gemm: bool, fix_router: bool) -> None:
    """Applies the `optimization.moe_grouped_gemm` and `optimization.fix_router` switches to every MoE block."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_gemm = moe_grouped_gemm
        elif isinstance(module, Qwen3MoeRouter):
            module.fixed = fix_router


def checkpoint_keys(param_name: str, num_experts: int) -> List[str]:
    """The HF checkpoint keys that hold parameter `param_name` (itself, unless a stacked expert weight)."""
    match = _STACKED.match(param_name)
    if not match:
        return [param_name]
    prefix = match["prefix"]
    projections = ("gate_proj", "up_proj") if match["name"] == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{e}.{proj}.weight" for proj in projections for e in range(num_experts)]


def param_from_checkpoint(param_name: str, tensors: Mapping[str, torch.Tensor], num_experts: int) -> torch.Tensor:
    """The full parameter from its checkpoint tensors (`tensors` holds at least `checkpoint_keys(...)`)."""
    keys = checkpoint_keys(param_name, num_experts)
    if keys == [param_name]:
        return tensors[param_name]
    per_expert = torch.stack([tensors[k] for k in keys])  # (E or 2E, rows, cols)
    if _STACKED.match(param_name)["name"] == "down_proj":
        return per_expert
    gate, up = per_expert.split(num_experts)
    return torch.cat([gate, up], dim=1)  # gate rows then up rows, as transformers stacks them


def param_to_checkpoint(param_name: str, full: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Checkpoint key → tensor for one full parameter (stacked experts split into transformers' layout)."""
    match = _STACKED.match(param_name)
    if not match:
        return {param_name: full}
    prefix, num_experts = match["prefix"], full.shape[0]
    if match["name"] == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": full[e].contiguous() for e in range(num_experts)}
    gate, up = full.chunk(2, dim=1)
    out = {f"{prefix}.{e}.gate_proj.weight": gate[e].contiguous() for e in range(num_experts)}
    out.update({f"{prefix}.{e}.up_proj.weight": up[e].contiguous() for e in range(num_experts)})
    return out


def to_hf_checkpoint(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A full state dict of this model → the tensors transformers' `save_pretrained` writes."""
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        out.update(param_to_checkpoint(name, tensor))
    return out


def from_hf_checkpoint(checkpoint: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Checkpoint tensors (one per expert) → this model's state dict (stacked experts)."""
    experts: Dict[str, int] = {}
    out: Dict[str, torch.Tensor] = {}
    for key, tensor in checkpoint.items():
        match = _PER_EXPERT.match(key)
        if match:
            experts[match["prefix"]] = max(experts.get(match["prefix"], 0), int(match["expert"]) + 1)
        else:
            out[key] = tensor
    for prefix, num_experts in experts.items():
        for name in ("gate_up_proj", "down_proj"):
            out[f"{prefix}.{name}"] = param_from_checkpoint(f"{prefix}.{name}", checkpoint, num_experts)
    return out
