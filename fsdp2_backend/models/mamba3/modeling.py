"""The Mamba-3 causal LM (Lahoti et al., "Mamba-3: Improved Sequence Modeling using State Space Principles",
2026) as a Hugging Face `PreTrainedModel`: embeddings → pre-norm residual Mamba-3 blocks → final norm → lm head.

The mixer follows mamba_ssm's `Mamba3` module: one input projection split into [z, x, B, C, Δ, A, λ, angles];
A = min(−softplus(·), −A_floor) and Δ = softplus(· + dt_bias) (clamped to `time_step_limit`), both per head
and data-dependent; B and C RMS-normalised, plus per-head (and per-rank) biases; data-dependent rotary angles
on B and C; the exponential-trapezoidal scan (`kernels.mamba3_scan`, chunked, linear in length); the D skip;
y·silu(z), or the gated RMSNorm per head when `is_outproj_norm`; MIMO (rank R) projects x and z up and the
output down per head with `mimo_x`, `mimo_z`, `mimo_o`. Parameter names are mamba_ssm's.

Where this differs from MindSpeed-LLM's mamba3 model, and why: each block normalises its input (pre-norm,
as mamba_ssm's `Block` and every Mamba LM do; without it activations grow layer by layer); every size comes
from the config (MindSpeed builds the mixer with its defaults whatever config.json says); the embedding has
`vocab_size` rows (MindSpeed pads it to 200000); packed documents reset the state (MindSpeed refuses them);
any micro-batch size runs; the embedding is `model.embed_tokens` (transformers' name, which the default
`fsdp_modules` and MindSpeed's example YAML use; MindSpeed's model calls it `model.embeddings`). The rotary convention is mamba_ssm's SISO one (interleaved pairs, the first
state_size·rope_fraction/2 of them rotated), for MIMO too: a fixed relabelling of state dimensions, so it
matters only when importing weights trained with the tilelang MIMO kernel's layout.

Plain `nn.Module`s: no process groups. Packed rows are read from `position_ids` restarting at 0
(`kernels.varlen`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from fsdp2_backend.models.mamba3.configuration import Mamba3Config
from fsdp2_backend.kernels.mamba3_scan import mamba3_scan
from fsdp2_backend.kernels.rmsnorm import rms_norm_reference
from fsdp2_backend.kernels.rmsnorm_gated import rms_norm_gated, rms_norm_gated_reference
from fsdp2_backend.kernels.varlen import cu_seqlens_from_position_ids, is_packed


class Mamba3RMSNorm(nn.Module):
    """The plain RMSNorm of the blocks and the final norm (HF math; `use_fused_rmsnorm` swaps it)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(hidden_states, self.weight, self.variance_epsilon)


class Mamba3RMSNormGated(nn.Module):
    """A (grouped, gated) RMSNorm; `use_kernel` (set by `use_triton_rmsnormgated`) runs the dispatching op."""

    def __init__(self, hidden_size: int, eps: float, group_size: Optional[int] = None, norm_before_gate: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.use_kernel = False

    def forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        fn = rms_norm_gated if self.use_kernel else rms_norm_gated_reference
        return fn(hidden_states, gate, self.weight, self.variance_epsilon, group_size=self.group_size,
                  norm_before_gate=self.norm_before_gate)


class Mamba3Mixer(nn.Module):
    """The Mamba-3 sequence mixer (see the module docstring)."""

    def __init__(self, config: Mamba3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.d_inner, self.nheads, self.headdim = config.d_inner, config.num_heads, config.head_dim
        self.d_state, self.ngroups, self.rank = config.state_size, config.n_groups, config.rank
        self.num_rope_angles, self.chunk_size = config.num_rope_angles, config.chunk_size
        self.is_mimo, self.is_outproj_norm = config.is_mimo, config.is_outproj_norm
        self.A_floor = config.A_floor
        self.dt_limit = tuple(config.time_step_limit)
        self.dt_min, self.dt_max, self.dt_init_floor = config.time_step_min, config.time_step_max, config.time_step_floor
        self.split = [self.d_inner, self.d_inner, self.d_state * self.ngroups * self.rank,
                      self.d_state * self.ngroups * self.rank, self.nheads, self.nheads, self.nheads,
                      self.num_rope_angles]
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.use_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.B_bias = nn.Parameter(torch.ones(self.nheads, self.rank, self.d_state))
        self.C_bias = nn.Parameter(torch.ones(self.nheads, self.rank, self.d_state))
        self.B_norm = Mamba3RMSNormGated(self.d_state, eps=1e-5)  # mamba_ssm's fixed eps for B / C
        self.C_norm = Mamba3RMSNormGated(self.d_state, eps=1e-5)
        if self.is_mimo:
            self.mimo_x = nn.Parameter(torch.full((self.nheads, self.rank, self.headdim), 1.0 / self.rank))
            self.mimo_z = nn.Parameter(torch.ones(self.nheads, self.rank, self.headdim))
            self.mimo_o = nn.Parameter(torch.full((self.nheads, self.rank, self.headdim), 1.0 / self.rank))
        self.D = nn.Parameter(torch.ones(self.nheads))
        if self.is_outproj_norm:
            self.norm = Mamba3RMSNormGated(self.d_inner, eps=config.layer_norm_epsilon, group_size=self.headdim,
                                           norm_before_gate=True)
        self.out_proj = nn.Linear(self.d_inner, config.hidden_size, bias=config.use_bias)
        self.dt_bias._no_weight_decay = True
        self.D._no_weight_decay = True

    def _heads(self, t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """(b, l, R·G·N) → (b, l, R, H, N): each group serves H/G consecutive heads; plus the per-head bias."""
        b, l = t.shape[:2]
        t = t.view(b, l, self.rank, self.ngroups, 1, self.d_state)
        t = t.expand(-1, -1, -1, -1, self.nheads // self.ngroups, -1).reshape(b, l, self.rank, self.nheads, -1)
        return t + bias.transpose(0, 1)

    def forward(self, u: torch.Tensor, doc_start: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, l, _ = u.shape
        z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(self.in_proj(u), self.split, dim=-1)
        A = torch.clamp(-F.softplus(dd_A.float()), max=-self.A_floor)
        dt = F.softplus(dd_dt.float() + self.dt_bias.float())
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.dt_limit)
        k = self._heads(self.B_norm(B.unflatten(-1, (-1, self.d_state))).flatten(-2), self.B_bias)
        q = self._heads(self.C_norm(C.unflatten(-1, (-1, self.d_state))).flatten(-2), self.C_bias)
        x = x.unflatten(-1, (self.nheads, self.headdim))
        z = z.unflatten(-1, (self.nheads, self.headdim))
        v = x.unsqueeze(2) * self.mimo_x.transpose(0, 1) if self.is_mimo else x.unsqueeze(2)  # (b, l, R, H, P)
        angles = angles.unsqueeze(2).expand(-1, -1, self.nheads, -1)
        y = mamba3_scan(q, k, v, A * dt, dt, trap, angles, chunk_size=self.chunk_size, doc_start=doc_start)
        y = y + self.D.float()[:, None] * v.float()  # (b, l, R, H, P)
        zr = z.unsqueeze(2) * self.mimo_z.transpose(0, 1) if self.is_mimo else z.unsqueeze(2)
        if self.is_outproj_norm:
            y = self.norm(y.flatten(-2), zr.float().flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
        else:
            y = y * F.silu(zr.float())
        y = (y * self.mimo_o.transpose(0, 1)).sum(2) if self.is_mimo else y.squeeze(2)
        return self.out_proj(y.flatten(-2).to(u.dtype))


class Mamba3Block(nn.Module):
    """x + mixer(norm(x)); the residual stream kept in fp32 when `residual_in_fp32`."""

    def __init__(self, config: Mamba3Config, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = Mamba3RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mamba = Mamba3Mixer(config, layer_idx)

    def forward(self, hidden_states: torch.Tensor, doc_start: Optional[torch.Tensor] = None) -> torch.Tensor:
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        out = self.mamba(self.norm(hidden_states), doc_start)
        return (residual + out).to(hidden_states.dtype)


class Mamba3PreTrainedModel(PreTrainedModel):
    config_class = Mamba3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Mamba3Block"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if getattr(module, "_is_out_proj", False) and self.config.rescale_prenorm_residual:
            # transformers' Mamba-2 option (GPT-2's scheme): out_proj's init scaled by 1/sqrt(n_layer)
            std = self.config.initializer_range / math.sqrt(self.config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
            return
        super()._init_weights(module)
        if isinstance(module, Mamba3Mixer):
            # Δ's bias: softplus⁻¹ of a log-uniform Δ in [dt_min, dt_max] (mamba_ssm's initialisation)
            dt = torch.exp(torch.rand(module.nheads) * (math.log(module.dt_max) - math.log(module.dt_min))
                           + math.log(module.dt_min)).clamp(min=module.dt_init_floor)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
            init.ones_(module.B_bias)
            init.ones_(module.C_bias)
            init.ones_(module.D)
            if module.is_mimo:
                init.constant_(module.mimo_x, 1.0 / module.rank)
                init.ones_(module.mimo_z)
                init.constant_(module.mimo_o, 1.0 / module.rank)


class Mamba3Model(Mamba3PreTrainedModel):
    def __init__(self, config: Mamba3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Mamba3Block(config, i) for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            layer.mamba.out_proj._is_out_proj = True
        self.norm_f = Mamba3RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, position_ids=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        doc_start = None
        if is_packed(position_ids):  # documents restart the state, the angle and the previous-token term
            cu_seqlens, _ = cu_seqlens_from_position_ids(position_ids)
            doc_start = torch.zeros(position_ids.numel(), dtype=torch.bool, device=hidden.device)
            doc_start[cu_seqlens[:-1].long()] = True
            doc_start = doc_start.view(position_ids.shape)
        for layer in self.layers:
            hidden = layer(hidden, doc_start)
        return self.norm_f(hidden)


class Mamba3ForCausalLM(Mamba3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Mamba3Config):
        super().__init__(config)
        self.model = Mamba3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """`attention_mask` may only mark every token (no padding inside a recurrence); labels as HF's (shifted
        inside the loss)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("Mamba3ForCausalLM: padded batches are not supported — pack documents with "
                             "position_ids restarting at 0 instead")
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, inputs_embeds=inputs_embeds)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and logits_to_keep else slice(None)
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def register_with_transformers() -> None:
    """Registers model_type "mamba3" with AutoConfig and AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "mamba3" not in CONFIG_MAPPING:
        AutoConfig.register("mamba3", Mamba3Config)
        AutoModelForCausalLM.register(Mamba3Config, Mamba3ForCausalLM)


def build_mamba3(hf_config) -> Mamba3ForCausalLM:
    """The model for any HF config carrying the Mamba-3 fields (ours, or MindSpeed's Mamba-2 style one)."""
    return Mamba3ForCausalLM(Mamba3Config.from_any(hf_config))


register_with_transformers()  # AutoConfig / AutoModelForCausalLM load a saved mamba3 directory once this is imported
