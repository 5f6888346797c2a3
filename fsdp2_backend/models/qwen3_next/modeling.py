"""The `qwen3_next` model id: transformers' Qwen3-Next with this project's Gated DeltaNet kernels, stacked
experts and router.

The model is transformers' `Qwen3NextForCausalLM` (gated full attention with partial rotary, zero-centred
RMSNorm, the sigmoid-gated dense shared expert, aux-loss bookkeeping, `_init_weights`), with three swaps:
- every `linear_attn` → `GatedDeltaNet`: the same parameters, its forward calling `kernels.causal_conv1d` and
  `kernels.gated_delta_rule` with the implementation the run chose (`configure_qwen3_next`) — transformers'
  hub-kernel lookup (which takes flash-linear-attention whenever it is importable, on any device) is never
  consulted. Packed rows (position ids restarting at 0, `kernels/varlen.py`) reset the conv window and the
  recurrent state at every document start; transformers' torch path would leak state across documents;
- `mlp.experts` → `GroupedExperts` (stacked weights, grouped GEMM, open to the EP dispatcher);
- `mlp.gate` → `Qwen3NextRouter` (`models.moe.router`: transformers' routing by default, Megatron's options,
  `fix_router`); the sparse block keeps transformers' sigmoid-gated dense shared expert.
State dict names and shapes equal transformers' in-memory ones, so transformers' `from_pretrained` /
`save_pretrained` read and write HF checkpoints (one tensor per expert on disk); the streaming loader uses the
qwen3_moe per-expert key mapping (same key layout). MTP keys (`mtp.*`) of released checkpoints are left by the
main model's loaders (as transformers does); with `model.mtp_num_layers` 1, `models/mtp_layouts.py` loads them
into the MTP layer (full attention, this module's stacked experts and router) and the export writes them back.

Generation with a cache (prefill / one-token decode) runs transformers' own GDN forward; training never does.
Context parallel for the GDN layers installs `context_parallel` on each `GatedDeltaNet` from outside
(`fsdp2_backend.parallel.context_parallel.linear_attention`); the module itself knows no process group.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextExperts, Qwen3NextForCausalLM,
                                                                Qwen3NextGatedDeltaNet, Qwen3NextSparseMoeBlock,
                                                                Qwen3NextTopKRouter, apply_mask_to_padding_states)

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter, attach_aux_loss
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
from fsdp2_backend.kernels.causal_conv1d import causal_conv1d, conv1d_implementation
from fsdp2_backend.kernels.gated_delta_rule import chunk_gated_delta_rule
from fsdp2_backend.kernels.rmsnorm_gated import rms_norm_gated
from fsdp2_backend.kernels.varlen import cu_seqlens_from_position_ids, is_packed

# Private kwargs from the model's forward to its GDN layers (attention functions ignore them; flash attention's
# cu_seq_lens_* are its own): the packed rows' cu_seqlens, and the position ids (context parallel gathers them).
CU_SEQLENS_KWARG = "gdn_cu_seqlens"
POSITIONS_KWARG = "gdn_position_ids"
Tensor = torch.Tensor


class Qwen3NextRouter(TopKRouter, Qwen3NextTopKRouter):
    """The router of `models.moe.router` (Megatron's options, `fix_router`; by default transformers' Qwen3-Next
    routing: softmax, top-k, renormalised when `norm_topk_prob`) that transformers still recognises as its
    Qwen3-Next router (its `router_logits` recorder, which feeds the aux loss, hooks that class)."""

    def __init__(self, config, fixed: bool = False):
        TopKRouter.__init__(self, RouterSettings.from_hf(config), config.hidden_size)
        self.norm_topk_prob = config.norm_topk_prob
        self.fixed = fixed


class Qwen3NextGroupedBlock(Qwen3NextSparseMoeBlock):
    """transformers' sparse block (routed experts + sigmoid-gated dense shared expert), handing the router the
    (batch, seq, hidden) input so that a per-sequence aux loss can tell the sequences apart."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, length, hidden = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden)
        shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        _, weights, experts = self.gate(hidden_states)
        out = self.experts(flat, experts, weights) + shared
        return out.reshape(batch, length, hidden)


class GatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet mixer over this project's kernels (parameters as transformers' module)."""

    chunk_size: int = 64
    implementation: str = "torch"  # kernels.gated_delta_rule: "torch" | "triton" | "npu"
    fused_norm: bool = False  # use_triton_rmsnormgated: kernels.rmsnorm_gated (by device) for the output norm
    # Set from outside by context parallel: (module, q, k, v, b, a, position_ids of this shard) -> core output
    # [B, T_local, H, V]; it calls `mix` on the whole sequence for its share of the heads.
    context_parallel: Optional[Callable] = None

    def _head_params(self, k_heads: slice, v_heads: slice) -> Tuple[Tensor, Tensor, Tensor]:
        """(conv weight [C, W], A_log, dt_bias) of the given key / value heads (all heads without CP)."""
        weight = self.conv1d.weight.squeeze(1)
        if k_heads == slice(None) and v_heads == slice(None):
            return weight, self.A_log, self.dt_bias
        kd, vd = self.head_k_dim, self.head_v_dim
        q_rows = weight[: self.key_dim].view(self.num_k_heads, kd, -1)[k_heads].flatten(0, 1)
        k_rows = weight[self.key_dim: 2 * self.key_dim].view(self.num_k_heads, kd, -1)[k_heads].flatten(0, 1)
        v_rows = weight[2 * self.key_dim:].view(self.num_v_heads, vd, -1)[v_heads].flatten(0, 1)
        return torch.cat([q_rows, k_rows, v_rows]), self.A_log[v_heads], self.dt_bias[v_heads]

    def mix(self, query: Tensor, key: Tensor, value: Tensor, b: Tensor, a: Tensor, cu_seqlens: Optional[Tensor],
            k_heads: slice = slice(None), v_heads: slice = slice(None)) -> Tensor:
        """Conv + gated delta rule for the given heads. query/key [B, T, hk, K] and value [B, T, h, V] before the
        conv, b/a [B, T, h] → core output [B, T, h, V] (before the gated norm)."""
        batch, length, hk, _ = query.shape
        h = value.shape[2]
        weight, a_log, dt_bias = self._head_params(k_heads, v_heads)
        mixed = torch.cat([x.reshape(batch, length, -1) for x in (query, key, value)], dim=-1)
        # The conv runs triton exactly where the gated delta rule does (use_triton_gdn on CUDA).
        mixed = causal_conv1d(mixed, weight, self.conv1d.bias, self.activation, cu_seqlens,
                              implementation=conv1d_implementation(mixed.device.type, self.implementation))
        query, key, value = mixed.split([hk * self.head_k_dim, hk * self.head_k_dim, h * self.head_v_dim], dim=-1)
        query, key = (x.reshape(batch, length, hk, self.head_k_dim) for x in (query, key))
        value = value.reshape(batch, length, h, self.head_v_dim)
        beta = b.sigmoid()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # in fp32, as transformers
        out, _ = chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
                                        use_qk_l2norm_in_kernel=True, implementation=self.implementation)
        return out

    def forward(self, hidden_states: Tensor, cache=None, attention_mask: Optional[Tensor] = None, **kwargs):
        cu_seqlens = kwargs.pop(CU_SEQLENS_KWARG, None)
        position_ids = kwargs.pop(POSITIONS_KWARG, None)
        if cache is not None:  # generation: transformers' cached prefill / decode path
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                       self.in_proj_ba(hidden_states))
        if self.context_parallel is not None:
            core = self.context_parallel(self, query, key, value, b, a, position_ids)
        else:
            core = self.mix(query, key, value, b, a, cu_seqlens)
        shape = z.shape
        core, z = core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)
        if self.fused_norm:
            core = rms_norm_gated(core, z, self.norm.weight, self.norm.variance_epsilon).reshape(shape)
        else:
            core = self.norm(core, z).reshape(shape)
        return self.out_proj(core.reshape(shape[0], shape[1], -1))


def _adopt(new: nn.Module, old: nn.Module, names) -> nn.Module:
    for name in names:
        setattr(new, name, getattr(old, name))
    return new


def _swap_layer(config, layer) -> None:
    if getattr(layer, "linear_attn", None) is not None:
        old = layer.linear_attn
        with torch.device("meta"):  # parameters are the HF module's own, taken over below
            new = GatedDeltaNet(config, old.layer_idx)
        layer.linear_attn = _adopt(new, old, ("conv1d", "in_proj_qkvz", "in_proj_ba", "norm", "out_proj",
                                              "dt_bias", "A_log"))
    if isinstance(layer.mlp, Qwen3NextSparseMoeBlock):
        experts: Qwen3NextExperts = layer.mlp.experts
        with torch.device("meta"):
            grouped = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                     experts.act_fn)
            router = Qwen3NextRouter(config)
        layer.mlp.experts = _adopt(grouped, experts, ("gate_up_proj", "down_proj"))
        layer.mlp.gate = _adopt(router, layer.mlp.gate, ("weight",))
        layer.mlp.__class__ = Qwen3NextGroupedBlock  # same submodules and parameters, our forward


class Qwen3NextGroupedForCausalLM(Qwen3NextForCausalLM):
    """`Qwen3NextForCausalLM` with `GatedDeltaNet` mixers, `GroupedExperts` and `Qwen3NextRouter` (same weights).

    A packed batch (position ids restarting at 0) reaches the GDN layers as `cu_seqlens`; the full-attention
    layers see the same position ids, from which transformers builds its block-diagonal causal mask."""

    # transformers' cached "may this class take config._experts_implementation?", fixed (models/moe/grouped_causal_lm)
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            _swap_layer(config, layer)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GroupedExperts):  # as transformers initialises its Qwen3NextExperts
            from transformers import initialization as init

            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, TopKRouter):  # transformers initialises it from the block; a seeded meta-device
            # initialisation visits the router itself. Megatron's expert bias starts at 0.
            from transformers import initialization as init

            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            module.reset_buffers()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        """transformers' forward, packed rows' `cu_seqlens` handed to the GDN layers; with Megatron's router
        losses on, `aux_loss` is their weighted sum over the layers (as `qwen3_moe`)."""
        if position_ids is not None:
            kwargs.setdefault(POSITIONS_KWARG, position_ids)
            if CU_SEQLENS_KWARG not in kwargs and is_packed(position_ids):
                kwargs[CU_SEQLENS_KWARG] = cu_seqlens_from_position_ids(position_ids)[0]
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              **kwargs)
        return attach_aux_loss(self, out)

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """transformers' save (per-expert layout on disk), naming transformers' own class in config.json."""
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            self.config.architectures = [Qwen3NextForCausalLM.__name__]
            self.config.save_pretrained(save_directory)


def build_qwen3_next(hf_config) -> Qwen3NextGroupedForCausalLM:
    """The registry builder: the model for an HF `Qwen3NextConfig`."""
    return Qwen3NextGroupedForCausalLM(hf_config)


def configure_qwen3_next(model: nn.Module, *, moe_grouped_gemm: bool, fix_router: bool, gdn_chunk_size: int,
                         gdn_implementation: str, fused_gated_norm: bool = False, model_args=None) -> None:
    """Applies the run's switches: the MoE ones as `qwen3_moe.configure_moe` (grouped GEMM, fix_router, the
    `model.moe_router_*` fields), the GDN chunk size, implementation (`kernels.gated_delta_rule.
    gdn_implementation`) and gated-norm kernel (use_triton_rmsnormgated) to every GDN layer."""
    configure_moe(model, moe_grouped_gemm=moe_grouped_gemm, fix_router=fix_router, model_args=model_args)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.chunk_size = gdn_chunk_size
            module.implementation = gdn_implementation
            module.fused_norm = fused_gated_norm
