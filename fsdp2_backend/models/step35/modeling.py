"""The `step35` model id: StepFun Step-3.5-Flash (`model_type: step3p5`) as a causal LM around transformers'
Step-3.5 text model, with grouped-GEMM experts and the project's router.

transformers 5 has the Step-3.5 text decoder only as `Step3p7TextModel` (its config class `Step3p7TextConfig`
has `model_type = "step3p5"` and reads Step-3.5's config.json keys), and no causal LM for it. This module adds
the lm head and keeps everything else transformers': mixed full / sliding-window attention with per-layer-type
head counts (`per_layer_config`), q/k per-head zero-centred RMSNorm, the head-wise sigmoid output gate
(`g_proj`), per-layer-type rope theta and partial rotary (llama3 scaling on the `yarn_only_types` layers), the
dense first layers and the shared expert with their clamped SwiGLU (`swiglu_limits_shared`),
`_init_weights`. Two swaps in every sparse block:
- `mlp.experts` → `Step35Experts`: `GroupedExperts` (transformers' in-memory layout `gate_up_proj` (E, 2I, H),
  `down_proj` (E, H, I)) with Step-3.5's clamp per layer (`swiglu_limits`: silu(gate) clamped above, up both
  ways), so expert parallelism, `ep_fsdp`, the dispatchers, grouped GEMM and `fix_router` act on it;
- `mlp.gate` → `Step35Router` (`models.moe.router`): sigmoid scores, experts selected on
  `scores + e_score_correction_bias` (the checkpoint's `moe.router_bias`), the unbiased scores of the k
  renormalised (+1e-20, as Step-3.5's `router_bias_func`) and multiplied by `moe_router_scaling_factor`;
  fp32 logits when `need_fp32_gate`. Megatron's router options apply on top; the bias is the checkpoint's and
  is not updated (Megatron's expert-bias update is declined for this id in config validation).

Context parallel needs nothing here: transformers' attention calls the attention interface between RoPE and the
head-wise gate, so Ulysses / ring (`parallel/context_parallel/attention.py`) see q/k/v already rotated at the
shard's global positions (the cp batch carries them), return all heads of the local tokens, and the gate then
multiplies each head of those tokens; sliding layers keep their window (Ulysses: over the gathered sequence,
ring: by global positions). Ulysses splits each layer type's own heads: validation checks every type
(`config/rules/parallel.py`).

Where transformers' Step-3.7 code differs from Step-3.5's own modeling code (stepfun-ai/Step-3.5-Flash
`modeling_step3p5.py`), this module follows Step-3.5 (see `check_step35_config`): the routed scaling factor is
applied to the routing weights (Step-3.7 scales the block output: the same sum); the renormalisation adds 1e-20.

On disk (Step-3.5's own key names) each sparse layer holds `moe.gate.weight`, `moe.router_bias`, stacked
`moe.{gate,up,down}_proj.weight` ((E, I, H) / (E, H, I)) and `share_expert.*`. The streaming loader maps them one
parameter at a time (`checkpoint_keys` / `param_from_checkpoint`); transformers' own `from_pretrained` /
`save_pretrained` do the same through the MoE part of its "step3p7" conversion mapping, registered for this class
(`register_with_transformers`), so the HF export writes Step-3.5's keys and a config.json of model type step3p5.
The checkpoint's MTP layers (`model.layers.{N..}`) are not part of this model: the loader leaves them, with one
log line (`configure_step35`), unless `model.mtp_num_layers` is set: then `models/mtp_layouts.py` loads them into
the MTP layers, which train and are exported back under the same keys.
"""
from __future__ import annotations

import json
import os
import re
from typing import List, Mapping, Optional

import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import (Step3p7Experts, Step3p7PreTrainedModel,
                                                          Step3p7SparseMoeBlock, Step3p7TextModel,
                                                          Step3p7TopKRouter)

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter, attach_aux_loss
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
from fsdp2_backend.usage_errors import UsageError

_STACKED = re.compile(r"^(?P<layer>.*)\.mlp\.experts\.(?P<name>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<layer>.*)\.mlp\.gate\.(?P<name>weight|e_score_correction_bias)$")
_SHARED = re.compile(r"^(?P<layer>.*)\.mlp\.shared_experts\.(?P<rest>.*)$")
_ON_DISK_ROUTER = {"weight": "moe.gate.weight", "e_score_correction_bias": "moe.router_bias"}


class Step35Experts(GroupedExperts):
    """Stacked experts with Step-3.5's clamped SwiGLU (`limit` None: no clamp)."""

    def __init__(self, config, limit: Optional[float]):
        super().__init__(config.num_local_experts, config.hidden_size, config.moe_intermediate_size,
                         torch.nn.functional.silu)
        self.limit = limit

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return self.act_fn(gate) * up
        return self.act_fn(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, limit={self.limit}"


class Step35Router(TopKRouter, Step3p7TopKRouter):
    """Step-3.5's routing as the project's router (Megatron's options, `fix_router`), recognised by transformers
    as its Step router (its `router_logits` recorder hooks that class). Holds the selection bias
    `e_score_correction_bias` (transformers' name for the checkpoint's `moe.router_bias`)."""

    def __init__(self, config):
        settings = RouterSettings.from_hf(config, score_function="sigmoid",
                                          scaling_factor=getattr(config, "moe_router_scaling_factor", None),
                                          dtype="fp32" if getattr(config, "need_fp32_gate", False) else None)
        TopKRouter.__init__(self, settings, config.hidden_size)
        self.register_buffer("e_score_correction_bias", torch.zeros(settings.num_experts))

    def forward(self, hidden_states: torch.Tensor):
        batch = hidden_states.shape[0] if hidden_states.dim() == 3 else 1
        logits = self.gating(hidden_states.reshape(-1, self.hidden_dim))
        weights, index = self.route(logits, batch, selection_bias=self.e_score_correction_bias)
        return logits, weights, index


class Step35MoeBlock(Step3p7SparseMoeBlock):
    """transformers' sparse block (shared expert + routed experts); the router gets the (batch, seq, hidden)
    input (sequence-level aux loss) and already applies the routed scaling factor to the weights."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        shared = self.shared_experts(hidden_states)
        _, weights, index = self.gate(hidden_states)
        routed = self.experts(hidden_states.reshape(-1, hidden_dim), index, weights)
        return routed.reshape(batch_size, sequence_length, hidden_dim) + shared


def _swap(config, block: Step3p7SparseMoeBlock) -> None:
    hf_experts, hf_router = block.experts, block.gate
    limit = None if hf_experts.limit == float("inf") else hf_experts.limit
    with torch.device("meta"):  # the parameters are replaced by the HF modules' own below
        experts, router = Step35Experts(config, limit), Step35Router(config)
    experts.gate_up_proj, experts.down_proj = hf_experts.gate_up_proj, hf_experts.down_proj
    router.weight = hf_router.weight
    for name, buf in router.named_buffers():  # Megatron's routing buffers: zeros where the weight lives
        setattr(router, name, torch.zeros_like(buf, device=router.weight.device))
    router.e_score_correction_bias = hf_router.e_score_correction_bias
    block.experts, block.gate = experts, router
    block.__class__ = Step35MoeBlock


class Step35ForCausalLM(Step3p7PreTrainedModel, GenerationMixin):
    """transformers' `Step3p7TextModel` (the Step-3.5 text decoder) + an lm head, with `Step35Experts` and
    `Step35Router` in its sparse blocks."""

    config_class = Step3p7TextConfig
    config: Step3p7TextConfig
    # transformers' "may this class take config._experts_implementation?" (models/moe/grouped_causal_lm.py): a
    # Step-3.5 config asks for grouped_mm (transformers >= 5.25), which our own experts serve
    _can_set_experts_implementation_cached_value = True
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["Step3p7DecoderLayer"]

    def __init__(self, config: Step3p7TextConfig):
        check_step35_config(config)
        super().__init__(config)
        self.model = Step3p7TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for layer in self.model.layers:
            if isinstance(layer.mlp, Step3p7SparseMoeBlock):
                _swap(config, layer.mlp)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs) -> MoeCausalLMOutputWithPast:
        """The text model, the lm head, transformers' causal-LM loss when `labels` are given; with Megatron's
        router losses on, `aux_loss` is their weighted sum over the layers (added to `loss`)."""
        kwargs.pop("past_key_values", None)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
        result = MoeCausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                           attentions=out.attentions)
        return attach_aux_loss(self, result)

    def _init_weights(self, module):
        if isinstance(module, Step35Experts):  # as transformers initialises its Step3p7Experts
            hf = object.__new__(Step3p7Experts)
            hf.__dict__.update(module.__dict__)
            super()._init_weights(hf)
            return
        super()._init_weights(module)
        if isinstance(module, TopKRouter):  # Megatron's buffers start at 0 (the selection bias too, above)
            module.reset_buffers()

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """transformers' save through the registered mapping (Step-3.5's on-disk keys); config.json names
        Step-3.5's class and also carries Step-3.5's own config keys, so its remote code reads it too."""
        register_with_transformers()
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            path = os.path.join(str(save_directory), "config.json")
            with open(path) as f:
                saved = json.load(f)
            saved.update(step35_legacy_config(self.config))
            with open(path, "w") as f:
                json.dump(saved, f, indent=2, sort_keys=True)


def check_step35_config(config) -> None:
    """Declines the Step-3.5 configurations whose Step-3.5 behaviour transformers' Step-3.7 code does not
    build (one line each)."""
    if getattr(config, "use_head_wise_attn_gate", True) is False:
        raise UsageError("model_id step35: config.json sets use_head_wise_attn_gate false, which transformers' Step "
                         "text model always builds — use a Step-3.5 checkpoint with the head-wise gate")
    if getattr(config, "moe_router_activation", "sigmoid") not in (None, "sigmoid") and \
            not getattr(config, "use_moe_router_bias", True):
        raise UsageError("model_id step35: config.json routes with softmax (moe_router_activation), which this "
                         "model id does not build — Step-3.5 routes with sigmoid scores")


def step35_legacy_config(config) -> dict:
    """Step-3.5's own config.json keys (its remote code and vLLM/SGLang read these) for `config`."""
    n = config.num_hidden_layers
    by_type = config.rope_parameters
    moe = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]
    out = {"architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
           "num_attention_groups": config.num_key_value_heads, "moe_num_experts": config.num_local_experts,
           "moe_top_k": config.num_experts_per_tok, "moe_layers_enum": ",".join(map(str, moe)),
           "use_head_wise_attn_gate": True, "moe_router_activation": "sigmoid",
           "use_moe_router_bias": getattr(config, "use_moe_router_bias", True),
           "need_fp32_gate": getattr(config, "need_fp32_gate", False),
           "attention_other_setting": {"attention_type": "sliding_attention",
                                       "num_attention_heads": config.num_sliding_attention_heads,
                                       "num_attention_groups": config.num_key_value_heads,
                                       "head_dim": config.head_dim, "true_head_dim": config.head_dim},
           "rope_theta": [by_type[t]["rope_theta"] for t in config.layer_types],
           "partial_rotary_factors": [by_type[t].get("partial_rotary_factor", 1.0) for t in config.layer_types],
           # the export holds MTP layers only when they were trained (models/mtp_layouts.py records their number)
           "num_nextn_predict_layers": getattr(config, "mtp_num_layers", 0) or 0}
    scaled = [t for t, p in by_type.items() if p.get("rope_type", "default") != "default"]
    if scaled:
        scaling = dict(by_type[scaled[0]])
        scaling.pop("rope_theta", None)
        scaling.pop("partial_rotary_factor", None)
        out.update(rope_scaling=scaling, yarn_only_types=scaled)
    assert len(out["rope_theta"]) == n
    return out


_REGISTERED = []


def register_with_transformers() -> None:
    """Registers, for this class, the MoE renames of transformers' own "step3p7" checkpoint conversion (the
    Step-3.5 text keys: `moe.*`, `share_expert.*`), so transformers' `from_pretrained` / `save_pretrained` of this
    class read and write Step-3.5's on-disk layout."""
    if _REGISTERED:
        return
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    # the text decoder's renames: the ones not anchored at the multimodal checkpoint's top-level prefixes
    moe = [t for t in get_checkpoint_conversion_mapping("step3p7")
           if not any(p.startswith("^") for p in t.source_patterns)]
    for name in (Step35ForCausalLM.__name__, "FSDP" + Step35ForCausalLM.__name__):  # also once FSDP2-wrapped
        register_checkpoint_conversion_mapping(name, moe, overwrite=True)
    _REGISTERED.append(True)


def build_step35(hf_config) -> Step35ForCausalLM:
    """The registry builder."""
    return Step35ForCausalLM(hf_config)


def configure_step35(model: nn.Module, config) -> None:
    """The run's MoE switches and Megatron router fields (`qwen3_moe.configure_moe`); one line when the
    checkpoint carries MTP layers this model does not load."""
    configure_moe(model, moe_grouped_gemm=config.optimization.moe_grouped_gemm,
                  fix_router=config.optimization.fix_router, model_args=config.model)
    mtp = getattr(model.config, "num_nextn_predict_layers", 0) or 0
    if mtp and not getattr(config.model, "mtp_num_layers", None):  # with it: models/mtp_layouts.py loads them
        from fsdp2_backend.distributed.console import print_rank0

        n = model.config.num_hidden_layers
        print_rank0(f"model_id step35: the checkpoint's {mtp} MTP layers (model.layers.{n}-{n + mtp - 1}) are not "
                    f"loaded — this model trains the main layers only")


def checkpoint_keys(param_name: str, hf_config) -> List[str]:
    """The Step-3.5 checkpoint keys holding `param_name` (a parameter or persistent buffer of this model)."""
    match = _STACKED.match(param_name)
    if match:
        names = ("gate_proj", "up_proj") if match["name"] == "gate_up_proj" else ("down_proj",)
        return [f"{match['layer']}.moe.{n}.weight" for n in names]
    match = _ROUTER.match(param_name)
    if match:
        return [f"{match['layer']}.{_ON_DISK_ROUTER[match['name']]}"]
    match = _SHARED.match(param_name)
    if match:
        return [f"{match['layer']}.share_expert.{match['rest']}"]
    return [param_name]


def param_from_checkpoint(param_name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    """The full tensor from its checkpoint tensors: gate (E, I, H) and up (E, I, H) stacked as gate rows then up
    rows (transformers' Concatenate(dim=1))."""
    keys = checkpoint_keys(param_name, hf_config)
    if len(keys) == 1:
        return tensors[keys[0]]
    return torch.cat([tensors[k] for k in keys], dim=1)
