"""The `gpt_oss` model id: transformers' GPT-OSS with sink attention through SDPA, grouped-GEMM experts and the
project's router.

The model is transformers' `GptOssForCausalLM` (norms, YaRN rotary, alternating sliding / full attention
layers, `_init_weights`, the aux-loss bookkeeping) with three swaps:
- attention: `kernels.sink_attention` registered as transformers' attention implementation `sink_attention`
  (the sinks as one more key column of SDPA; transformers itself runs sinks only in eager attention on CPU);
- `mlp.experts` → `GptOssGroupedExperts`: transformers' parameters (`gate_up_proj` (E, H, 2I) with gate and up
  columns interleaved, `gate_up_proj_bias`, `down_proj` (E, I, H), `down_proj_bias`) computed by the grouped
  GEMM over slots grouped by expert, with GPT-OSS's clamped SwiGLU (`(up + 1) · gate · σ(α · gate)`, gate
  clamped above and up both ways at `swiglu_limit`);
- `mlp.router` → `GptOssRouter` (`models.moe.router`): top-k of the biased logits, softmax over the k —
  Megatron's softmax routing — plus Megatron's router options and `fix_router`.
`mlp_bias: false` in the config (Megatron's `--disable-bias-linear`, `megatron_compat/architecture/gpt_oss.py`):
Megatron's GPT-OSS then has no expert or router biases, which transformers' GPT-OSS always has — they are kept
at zero and frozen here (the same function; an export holds zeros, which transformers computes identically).
Parameter names and shapes equal transformers' (and the bf16 checkpoints'), so `from_pretrained` /
`save_pretrained` and the streaming loader need no key mapping. MXFP4 checkpoints (`*_blocks`, `*_scales`)
are dequantised by transformers' own `convert_moe_packed_tensors` while streaming (`param_from_checkpoint`).
"""
from __future__ import annotations

import re
from typing import List, Mapping

import torch
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import (GptOssExperts, GptOssForCausalLM, GptOssMLP,
                                                          GptOssTopKRouter)

from fsdp2_backend.distributed.dtensor import local_tensor
from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.grouped_causal_lm import GroupedMoECausalLM
from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter
from fsdp2_backend.kernels.grouped_gemm import grouped_linear
from fsdp2_backend.kernels.sink_attention import register_sink_attention

ATTENTION = "sink_attention"
_MXFP4 = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")


class GptOssGroupedExperts(GroupedExperts):
    """GPT-OSS experts (biases, interleaved gate/up, clamped SwiGLU) over the grouped GEMM; transformers'
    parameter layout (weights stored input-major: (E, in, out))."""

    def __init__(self, config):
        nn.Module.__init__(self)
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.act_fn = None
        self.use_grouped_gemm = False
        self.dispatcher = None

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts.to(x.device))
        gate_up = grouped_linear(x, local_tensor(self.gate_up_proj).transpose(1, 2), counts, self.use_grouped_gemm)
        gate_up = gate_up + local_tensor(self.gate_up_proj_bias)[expert_of_row].to(gate_up.dtype)
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        out = grouped_linear(act, local_tensor(self.down_proj).transpose(1, 2), counts, self.use_grouped_gemm)
        return out + local_tensor(self.down_proj_bias)[expert_of_row].to(out.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.gate_up_proj.shape[1]}, "
                f"intermediate={self.down_proj.shape[1]}, limit={self.limit}, grouped_gemm={self.use_grouped_gemm}")


class GptOssRouter(TopKRouter, GptOssTopKRouter):
    """GPT-OSS's router (a biased linear; softmax over the top-k logits) as the project's router, recognised by
    transformers as its GPT-OSS router (its `router_logits` recorder hooks that class)."""

    def __init__(self, config):
        # softmax over the top-k logits = Megatron's softmax routing without pre-softmax
        TopKRouter.__init__(self, RouterSettings.from_hf(config, pre_softmax=False), config.hidden_size, bias=True)


class GptOssGroupedMLP(GptOssMLP):
    """transformers' MLP block, handing the router the (batch, seq, hidden) input (sequence-level aux loss)."""

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        _, router_scores, router_indices = self.router(hidden_states)
        out = self.experts(hidden_states.reshape(-1, hidden_dim), router_indices, router_scores)
        return out.reshape(batch_size, sequence_length, hidden_dim), router_scores


def _swap(config, mlp: GptOssMLP) -> None:
    with torch.device("meta"):  # the parameters are replaced by the HF module's own below
        experts, router = GptOssGroupedExperts(config), GptOssRouter(config)
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        setattr(experts, name, getattr(mlp.experts, name))
    router.weight, router.bias = mlp.router.weight, mlp.router.bias
    for name, buf in router.named_buffers():
        setattr(router, name, torch.zeros_like(buf, device=router.weight.device))
    mlp.experts, mlp.router = experts, router
    mlp.__class__ = GptOssGroupedMLP
    if not getattr(config, "mlp_bias", True):
        for bias in _mlp_biases(mlp):
            bias.requires_grad_(False)


def _mlp_biases(mlp) -> List[nn.Parameter]:
    return [mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias, mlp.router.bias]


class GptOssGroupedForCausalLM(GroupedMoECausalLM, GptOssForCausalLM):
    """`GptOssForCausalLM` with sink attention through SDPA, `GptOssGroupedExperts` and `GptOssRouter`;
    transformers' init, save and aux loss through `GroupedMoECausalLM`."""

    hf_experts_class, hf_class = GptOssExperts, GptOssForCausalLM

    def __init__(self, config):
        register_sink_attention()
        config._attn_implementation = ATTENTION
        super().__init__(config)
        for layer in self.model.layers:
            _swap(config, layer.mlp)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, TopKRouter) and not getattr(self.config, "mlp_bias", True):
            torch.nn.init.zeros_(module.bias)  # Megatron's router without bias: zero, frozen

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """config.json also names eager attention (transformers' own for sinks on every device)."""
        implementation = self.config._attn_implementation
        self.config._attn_implementation = "eager"
        try:
            super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        finally:
            self.config._attn_implementation = implementation


def build_gpt_oss(hf_config) -> GptOssGroupedForCausalLM:
    """The registry builder."""
    return GptOssGroupedForCausalLM(hf_config)


def checkpoint_keys(param_name: str, hf_config) -> List[str]:
    """The checkpoint keys holding `param_name`: itself (bf16 checkpoints), or `_blocks` + `_scales` for the
    expert weights of an MXFP4 checkpoint (config.json's `quantization_config.quant_method`)."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if _MXFP4.match(param_name) and str(method).lower().endswith("mxfp4"):
        return [f"{param_name}_blocks", f"{param_name}_scales"]
    return [param_name]


def param_from_checkpoint(param_name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The parameter from its checkpoint tensors: MXFP4 blocks and scales dequantised by transformers'
    `convert_moe_packed_tensors` (which returns transformers' in-memory (E, in, out) layout)."""
    if param_name in tensors:
        return tensors[param_name]
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(tensors[f"{param_name}_blocks"], tensors[f"{param_name}_scales"],
                                      dtype=torch.float32)
