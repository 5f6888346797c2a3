"""The `qwen3_moe` model id: transformers' Qwen3-MoE with grouped-GEMM experts and a fixable router.

The model is transformers' `Qwen3MoeForCausalLM` (attention, norms, rotary, the aux-loss bookkeeping and
`_init_weights` are transformers' own) with two swaps in every sparse block:
- `mlp.experts` → `GroupedExperts` (stacked weights, same names and shapes as transformers' in-memory
  `Qwen3MoeExperts`: `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)), computed by a grouped GEMM and open
  to an expert-parallel dispatcher;
- `mlp.gate` → `Qwen3MoeRouter`, the project's router (`models.moe.router`): transformers' routing by default
  (softmax, top-k, `norm_topk_prob` renormalisation), Megatron's router options from `model.moe_router_*`,
  plus `fix_router`.
State dicts therefore equal transformers' in-memory ones, and transformers' `from_pretrained` /
`save_pretrained` convert to and from the on-disk layout, which holds one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`). Outside transformers, `checkpoint_keys` /
`param_from_checkpoint` / `param_to_checkpoint` convert one parameter at a time (for streaming loaders and
exporters), `to_hf_checkpoint` / `from_hf_checkpoint` whole state dicts.

The auxiliary load-balancing loss: with `model.moe_router_load_balancing_type` (or a z-loss) set, Megatron's
losses (`models.moe.router`): `outputs.aux_loss` is their weighted sum over the layers and the model's
`router_aux_loss_coef` is 1. Otherwise transformers': with the config's `output_router_logits`
`outputs.aux_loss` holds it unscaled and `outputs.loss`, when labels are given, already includes
`router_aux_loss_coef * aux_loss`. A trainer that computes its own loss adds
`model.router_aux_loss_coef * outputs.aux_loss`.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping

import torch
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeExperts, Qwen3MoeForCausalLM,
                                                              Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter)

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.family_swap import Family, swap_blocks
from fsdp2_backend.models.moe.router import (ROUTER_CONFIG_KEY, RouterSettings, TopKRouter, attach_aux_loss,
                                            router_fields)

_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<name>gate_proj|up_proj|down_proj)"
                         r"\.weight$")


class Qwen3MoeRouter(TopKRouter, Qwen3MoeTopKRouter):
    """The router of `models.moe.router` (Megatron's options; by default transformers' Qwen3-MoE routing:
    softmax, top-k, renormalised when `norm_topk_prob`) that transformers still recognises as its Qwen3-MoE
    router (its `router_logits` recorder hooks that class)."""

    def __init__(self, config, fixed: bool = False):
        TopKRouter.__init__(self, RouterSettings.from_hf(config), config.hidden_size)
        self.norm_topk_prob = config.norm_topk_prob
        self.fixed = fixed


class Qwen3MoeGroupedBlock(Qwen3MoeSparseMoeBlock):
    """transformers' sparse block, handing the router the (batch, seq, hidden) input so that the
    sequence-level aux loss can tell the sequences apart."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        _, routing_weights, selected_experts = self.gate(hidden_states)
        out = self.experts(hidden_states.reshape(-1, hidden_dim), selected_experts, routing_weights)
        return out.reshape(batch_size, sequence_length, hidden_dim)


class Qwen3MoeGroupedForCausalLM(Qwen3MoeForCausalLM):
    """`Qwen3MoeForCausalLM` whose sparse blocks use `GroupedExperts` and `Qwen3MoeRouter` (same weights)."""

    # transformers' cached "may this class take config._experts_implementation?", fixed (models/moe/grouped_causal_lm)
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config):
        super().__init__(config)
        swap_blocks(self, _FAMILY)  # the one block swap of every MoE family (models/moe/family_swap.py)

    def forward(self, *args, **kwargs):
        """transformers' forward; with Megatron's losses on, `aux_loss` is their weighted sum over the layers
        (and `router_aux_loss_coef` is 1: the coefficients are already in)."""
        out = super().forward(*args, **kwargs)
        return attach_aux_loss(self, out)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GroupedExperts):  # as transformers initialises its Qwen3MoeExperts
            from transformers import initialization as init

            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, TopKRouter):  # Megatron's expert bias starts at 0
            module.reset_buffers()

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """transformers' save (it writes the per-expert layout), naming transformers' own class in config.json
        so that any HF loader builds the stock Qwen3-MoE from the export."""
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            self.config.architectures = [Qwen3MoeForCausalLM.__name__]
            self.config.save_pretrained(save_directory)


_FAMILY = Family(Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock, Qwen3MoeExperts, Qwen3MoeGroupedBlock, Qwen3MoeRouter,
                 lambda c: c.num_experts)


def build_qwen3_moe(hf_config) -> Qwen3MoeGroupedForCausalLM:
    """The registry builder: the model for an HF `Qwen3MoeConfig` (the aux loss is on when the config's
    `output_router_logits` is, as in transformers)."""
    return Qwen3MoeGroupedForCausalLM(hf_config)


def configure_moe(model: nn.Module, *, moe_grouped_gemm: bool, fix_router: bool, model_args=None) -> None:
    """Applies the `optimization.moe_grouped_gemm` and `optimization.fix_router` switches and the
    `model.moe_router_*` fields (Megatron's router; unset fields keep the model's own routing) to every MoE
    block."""
    megatron_losses = False
    fields = router_fields(model_args) if model_args is not None else {}
    if fields:  # recorded in the config (checkpoints, export): the run continues with this router, flags or not
        setattr(model.config, ROUTER_CONFIG_KEY, fields)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_gemm = moe_grouped_gemm
        elif isinstance(module, TopKRouter):
            module.fixed = fix_router
            if model_args is not None:
                module.apply_settings(module.settings.with_model_fields(model_args))
                megatron_losses |= module.settings.megatron_losses
    if megatron_losses:  # Megatron's losses replace transformers' aux loss, their coefficients applied
        model.config.output_router_logits = False
        model.router_aux_loss_coef = 1.0


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
