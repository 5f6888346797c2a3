"""Megatron / MindSpeed Gated DeltaNet hybrid flags → a Qwen3-Next (`model_type qwen3_next`, `model.model_id
qwen3_next`).

The flags select Qwen3-Next when they describe linear-attention layers: MindSpeed's (`--full-attention-interval`,
`--linear-key-head-dim`, `--linear-value-head-dim`, `--linear-num-key-heads`, `--linear-num-value-heads`,
`--mamba-d-conv` as the conv width) or Megatron-LM's (`--experimental-attention-variant gated_delta_net`,
`--linear-attention-freq`, `--linear-conv-kernel-dim`). `architecture.apply` then treats the attention, MoE and
router flags as Qwen3-MoE's (Qwen3-Next's gated attention and experts are Qwen3-MoE's plus a gate) and calls
`apply` here for the rest:

  --full-attention-interval / --linear-attention-freq N → layer_types (every N-th layer full attention)
  --linear-{key,value}-head-dim, --linear-num-{key,value}-heads → the same keys
  --linear-conv-kernel-dim / --mamba-d-conv → linear_conv_kernel_dim
  --n-shared-experts (x --moe-ffn-hidden-size) / --moe-shared-expert-intermediate-size
      → shared_expert_intermediate_size (the shared expert is sigmoid-gated: --shared-expert-gate /
        --moe-shared-expert-gate say so; without them from scratch it is declined)
  --attention-output-gate, --qk-layernorm: what Qwen3-Next is (gated attention, q/k norms) → model_type
  --mamba-expand 1: no effect (the GDN value width is the head dims above); another value is declined.
  No --num-experts: a dense Qwen3-Next (num_experts 0). --no-enable-linear-qkv: no effect (HF's projections).
"""
from __future__ import annotations

from typing import Optional

from fsdp2_backend.models.registry import spec_for_model_type

SELECTING = ("full_attention_interval", "linear_attention_freq", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads", "linear_conv_kernel_dim")
BASE_FAMILY = "qwen3_moe"
_WHAT_IT_IS = ("attention_output_gate", "qk_layernorm", "experimental_attention_variant")


def selects_qwen3_next(ns, active) -> bool:
    """True when the flags describe Gated DeltaNet linear-attention layers."""
    if getattr(ns, "experimental_attention_variant", None) == "gated_delta_net":
        return True
    return any(dest in active for dest in SELECTING)


def _interval(a) -> Optional[int]:
    for dest in ("full_attention_interval", "linear_attention_freq"):
        value = a.get(dest)
        if value is None:
            continue
        if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            return int(value)
        a.decline(dest, f"{value!r}: only an integer interval (every N-th layer full attention) builds a "
                        "Qwen3-Next — give one, or --load with an HF directory")
    return None


def apply(a) -> None:
    """Sets the Qwen3-Next keys on `a` (an `architecture.Arch`) and the dispositions of the GDN flags."""
    g = a.get
    if a.from_scratch:
        a.keys["model_type"] = "qwen3_next"
        if a._set_field is not None:  # this project's model: our GDN kernels, packing, CP, stacked experts
            a._set_field(next((d for d in SELECTING if d in a.active), "experimental_attention_variant"),
                         "model.model_id", spec_for_model_type(a.keys["model_type"]).model_id)
        if not g("num_experts"):  # transformers' Qwen3-Next defaults to 512 experts; no --num-experts = dense
            a.keys["num_experts"] = 0
    a.note("no_enable_linear_qkv", "no_effect", "q/k/v projections are laid out as the HF model's")
    interval = _interval(a)
    layers = g("num_layers")
    if interval and layers:
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        for dest in ("full_attention_interval", "linear_attention_freq"):
            if g(dest) is not None:
                a.put(dest, "layer_types", types)
    for dest in ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"):
        a.put(dest, dest, g(dest))
    # The conv width: Megatron-LM's flag when given, else MindSpeed's --mamba-d-conv, else Megatron's default.
    conv = "mamba_d_conv" if "mamba_d_conv" in a.active and "linear_conv_kernel_dim" not in a.active else \
        "linear_conv_kernel_dim"
    a.put(conv, "linear_conv_kernel_dim", g(conv))
    if g("mamba_expand") not in (None, 1):
        a.decline("mamba_expand", f"{g('mamba_expand')}: Qwen3-Next's GDN value width is set by the linear head "
                                  "dims — drop it (1 is the only value), or give --load with an HF directory")
    else:
        a.note("mamba_expand", "no_effect", "Qwen3-Next's GDN value width is set by the linear head dims")
    if g("experimental_attention_variant") not in (None, "gated_delta_net"):
        a.decline("experimental_attention_variant", f"{g('experimental_attention_variant')!r} with linear-attention "
                  "flags: only gated_delta_net builds a Qwen3-Next")
    moe_ffn = g("moe_ffn_hidden_size") or g("moe_intermediate_size")
    shared = g("moe_shared_expert_intermediate_size")
    a.put("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size", shared)
    if g("n_shared_experts") and moe_ffn and not shared:
        a.put("n_shared_experts", "shared_expert_intermediate_size", g("n_shared_experts") * moe_ffn)
    elif g("n_shared_experts"):
        a.note("n_shared_experts", "mapped", "model.architecture.shared_expert_intermediate_size")
    gate = g("shared_expert_gate") or g("moe_shared_expert_gate")
    if a.from_scratch and (shared or g("n_shared_experts")) and not gate:
        a.decline("n_shared_experts" if g("n_shared_experts") else "moe_shared_expert_intermediate_size",
                  "Qwen3-Next's shared expert is sigmoid-gated — add --shared-expert-gate, or give --load with "
                  "an HF directory")
    for dest in _WHAT_IT_IS:
        if dest not in a.declined:
            a.note(dest, "mapped", "model.architecture.model_type (qwen3_next)")
