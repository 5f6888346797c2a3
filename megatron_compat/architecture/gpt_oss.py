"""Megatron-LM's gpt-oss flags → a GPT-OSS (`model_type gpt_oss`, `model.model_id gpt_oss`), from scratch or over
an HF directory.

What each flag means in Megatron-LM / megatron-core 0.16 and where it lands in transformers' `GptOssConfig`:

  --softmax-type learnable        learnable per-head softmax offset (`DotProductAttention.softmax_offset`):
                                  an extra logit column per head taking probability mass = GPT-OSS's `sinks`.
                                  vanilla / off-by-one: not GPT-OSS's attention → declined.
  --window-size L,R               flash-attention window (query i sees keys i-L..i+R); R must be 0 (causal).
                                  transformers' sliding window counts the query itself: sliding_window = L + 1.
  --window-attn-skip-freq N|list  `is_layer_window_attention`: 1-based layer l is windowed when l % N != 0 (a list:
                                  1 = windowed) → layer_types sliding_attention / full_attention. Without
                                  --window-size every layer is full attention.
  --quick-geglu                   GLU with quick_gelu(x) = x·σ(1.702·x) on the gate half → swiglu_alpha 1.702
                                  (GPT-OSS's activation); without it (plain --swiglu) the model is not GPT-OSS.
  --glu-linear-offset 1.0         the "+1" on the linear half, which GPT-OSS hard-codes: only 1.0 is buildable.
  --activation-func-clamp-value C gate clamped above at C, linear half to [-C, C] → swiglu_limit C (unset: no
                                  clamp, swiglu_limit inf).
  --position-embedding-type rope / --rope-type rope: plain RoPE at --rotary-base (rope_type default);
  --position-embedding-type yarn / --rope-type yarn: YaRN from the same flags as `architecture_mla` reads
                                  (`yarn_rope_scaling`: factor, beta_fast/slow, original context, mscales).
  --disable-bias-linear           no biases anywhere in Megatron: attention_bias false, and the expert and router
                                  biases that transformers' GPT-OSS always has kept at zero and frozen
                                  (`mlp_bias: false`, read by models/gpt_oss/modeling.py) — the same function.
  --enable-gpt-oss                read only by ModelOpt's model builder (megatron/post_training), which sets YaRN
                                  defaults when a ModelOpt checkpoint is loaded; a pretraining run ignores it →
                                  no effect (this file selects GPT-OSS from it).
  --export-force-local-attention  ModelOpt export's attention-module choice → no effect.
  --moe-z-loss-coeff and the other router flags: this project's router (models/moe/router.py), as for qwen3_moe.
Every GPT-OSS layer is an MoE layer: --moe-layer-freq other than 1 and --first-k-dense-replace are declined.
"""
from __future__ import annotations

from fsdp2_backend.models.registry import spec_for_model_type
from megatron_compat.architecture.mla import YARN_DESTS, yarn_rope_scaling

SELECTING = ("softmax_type", "enable_gpt_oss", "quick_geglu", "window_attn_skip_freq", "activation_func_clamp_value",
             "glu_linear_offset")
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x · σ(1.702 x)
_LOAD = "or give --load with an HF directory"


def selects_gpt_oss(ns, active) -> bool:
    """True when the flags describe GPT-OSS: learnable softmax (sinks), --enable-gpt-oss, or quick-GEGLU experts."""
    if getattr(ns, "enable_gpt_oss", False) or getattr(ns, "softmax_type", None) == "learnable":
        return True
    return bool(getattr(ns, "quick_geglu", False) and getattr(ns, "num_experts", None))


def _selector(a) -> str:
    """The first active flag that selected GPT-OSS (a decline must name a flag the script gives)."""
    return next((d for d in SELECTING if d in a.active), "num_experts")


def layer_types(num_layers: int, window_size, skip_freq) -> list:
    """megatron-core's `is_layer_window_attention` for every layer, as transformers' layer_types."""
    def windowed(layer: int) -> bool:  # 1-based, as megatron-core counts
        if not window_size:
            return False
        if skip_freq is None:
            return True
        if isinstance(skip_freq, int):
            return layer % skip_freq != 0
        return bool(skip_freq[layer - 1])
    return ["sliding_attention" if windowed(i + 1) else "full_attention" for i in range(num_layers)]


def _attention(a) -> None:
    g = a.get
    softmax = g("softmax_type") or "vanilla"
    if softmax != "learnable" and a.from_scratch:
        a.decline(_selector(a), f"GPT-OSS attention has learnable sinks; softmax type '{softmax}' is not "
                                f"buildable — use --softmax-type learnable, {_LOAD}")
    window, freq = g("window_size"), g("window_attn_skip_freq")
    if window is not None and (len(window) != 2 or window[1] != 0 or window[0] < 0):
        a.decline("window_size", f"{window}: only a causal window (left,0) is buildable — e.g. --window-size 127,0")
        return
    if window is not None:
        a.put("window_size", "sliding_window", int(window[0]) + 1)  # transformers counts the query itself
    if isinstance(freq, list) and g("num_layers") and len(freq) != g("num_layers"):
        a.decline("window_attn_skip_freq", f"{len(freq)} entries for {g('num_layers')} layers — give one per layer")
        return
    if g("num_layers") and (a.from_scratch or window is not None or freq is not None):
        types = layer_types(g("num_layers"), window, freq)
        a.put("window_attn_skip_freq" if freq is not None else "window_size", "layer_types", types)
        if "window_size" in a.active and "window_attn_skip_freq" in a.active:
            a.note("window_size", "mapped", "model.architecture.sliding_window, layer_types")
    elif "window_attn_skip_freq" in a.active:
        a.note("window_attn_skip_freq", "no_effect", "defined by the HF model in --load (its layer_types)")


def _rope(a) -> None:
    g = a.get
    yarn = "yarn" in (g("position_embedding_type"), g("rope_type"))
    given = YARN_DESTS & set(a.active)
    if yarn:
        active = set(a.active) | {"rope_type"}  # YaRN asked by --position-embedding-type alone: Megatron's defaults
        a.put(None, "rope_scaling", yarn_rope_scaling(_YarnView(a.ns), active))
        for dest in sorted(given):
            a.note(dest, "mapped", "model.architecture.rope_scaling (yarn)")
        a.note("position_embedding_type", "mapped", "model.architecture.rope_scaling (yarn)")
        return
    if a.from_scratch:  # transformers' GPT-OSS defaults to YaRN ×32: Megatron's plain RoPE says otherwise
        a.keys["rope_scaling"] = {"rope_type": "default"}
    a.note("rope_type", "mapped", "model.architecture.rope_scaling (default)")
    for dest in sorted(given - {"rope_type"}):
        a.note(dest, "no_effect", "YaRN options without YaRN (--position-embedding-type rope)")
    if (g("rotary_percent") or 1.0) != 1.0:
        a.decline("rotary_percent", "GPT-OSS rotates the whole head — use --rotary-percent 1.0, " + _LOAD)


class _YarnView:
    """The namespace with `rope_type` yarn, so that `yarn_rope_scaling` builds the dict."""

    def __init__(self, ns):
        self._ns = ns

    def __getattr__(self, name):
        return "yarn" if name in ("rope_type", "rope_scaling_type") else getattr(self._ns, name)


def _mlp(a) -> None:
    g = a.get
    if a.from_scratch and not g("quick_geglu"):
        a.decline(next((d for d in ("swiglu", "geglu") if d in a.active), _selector(a)),
                  "GPT-OSS experts use quick-GEGLU (x·σ(1.702x)·(y+1)) — use --quick-geglu --glu-linear-offset "
                  "1.0, " + _LOAD)
    a.put("quick_geglu", "swiglu_alpha", QUICK_GELU_ALPHA if g("quick_geglu") else None)
    offset = g("glu_linear_offset") or 0.0
    if offset != 1.0 and (a.from_scratch or "glu_linear_offset" in a.active):
        a.decline("glu_linear_offset", f"{offset}: GPT-OSS adds exactly 1 to the linear half — use "
                                       f"--glu-linear-offset 1.0, {_LOAD}")
    else:
        a.note("glu_linear_offset", "mapped", "model.architecture.model_type (gpt_oss: up + 1)")
    clamp = g("activation_func_clamp_value")
    a.put("activation_func_clamp_value" if clamp is not None else None, "swiglu_limit",
          float(clamp) if clamp is not None else (float("inf") if a.from_scratch else None))
    if g("num_experts") is None and a.from_scratch:
        a.decline(_selector(a), "GPT-OSS is a mixture of experts — give --num-experts")
    if g("moe_layer_freq") not in (None, 1):
        a.decline("moe_layer_freq", "every GPT-OSS layer is an MoE layer — drop --moe-layer-freq, " + _LOAD)
    if g("first_k_dense_replace"):
        a.decline("first_k_dense_replace", "every GPT-OSS layer is an MoE layer — drop it, " + _LOAD)
    if g("num_experts"):
        a.note("ffn_hidden_size", "no_effect", "every GPT-OSS layer is an MoE layer (--moe-ffn-hidden-size)")
    a.keys.pop("hidden_act", None)  # GPT-OSS's experts fix their activation; the key would only mislead
    for dest in ("swiglu", "squared_relu", "openai_gelu", "gelu_tanh"):
        if g(dest):
            a.decline(dest, "GPT-OSS experts use quick-GEGLU — use --quick-geglu, " + _LOAD)


def _biases(a) -> None:
    g = a.get
    if not a.from_scratch:
        a.note("add_bias_linear", "no_effect", "the HF model in --load defines its biases")
        return
    bias = bool(g("add_bias_linear"))
    a.put("add_bias_linear", "attention_bias", bias)
    a.keys["mlp_bias"] = bias  # False: expert and router biases zero and frozen (models/gpt_oss/modeling.py)
    if g("add_qkv_bias") and not bias:
        a.decline("add_qkv_bias", "GPT-OSS has biases on q/k/v and o together — drop --add-qkv-bias, " + _LOAD)


def apply(a) -> None:
    """Sets the GPT-OSS keys on `a` (an `architecture.Arch`) and the dispositions of the gpt-oss flags."""
    if a._set_field is not None:  # this project's model: sink attention through SDPA, grouped experts, router
        a._set_field(_selector(a), "model.model_id", spec_for_model_type("gpt_oss").model_id)  # the id building it
    if a.get("moe_router_pre_softmax"):  # softmax before the top-k: Megatron's option, this project's router
        a.field("moe_router_pre_softmax", "model.moe_router_pre_softmax", True)
    _attention(a)
    _rope(a)
    _mlp(a)
    _biases(a)
    a.note("enable_gpt_oss", "no_effect", "read only by ModelOpt's model builder (a ModelOpt checkpoint in --load); "
                                          "GPT-OSS is selected from it here")
    a.note("export_force_local_attention", "no_effect", "ModelOpt export's attention-module choice")
    a.note("quick_geglu", "mapped", "model.architecture.swiglu_alpha")
    a.note("softmax_type", "mapped", "model.architecture.model_type (gpt_oss: learnable sinks)")
