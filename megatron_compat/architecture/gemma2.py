"""MindSpeed-LLM's Gemma-2 lines (`--spec mindspeed_llm.tasks.models.spec.gemma2_spec layer_spec`,
`--model-type-hf gemma2`, or Gemma-2's own flags) → HF `gemma2` config keys (transformers' Gemma2ForCausalLM).

What MindSpeed's Gemma-2 layer does with each flag, and the HF key that says the same:
- `--post-norm`: a norm after attention and after the MLP as well as before (the sandwich): Gemma-2's four norms a
  layer, which the HF model always has;
- `--add-rmsnorm-offset`: RMSNorm scaled by (1 + weight), Gemma's norm; `--input-embeds-norm`: the embeddings
  times sqrt(hidden size), Gemma's normaliser. Both always in HF Gemma-2, so a from-scratch line must give all
  three (MindSpeed's own Gemma-2 scripts do), else it describes a model HF cannot build;
- `--query-pre-attn-scalar S`: attention scores scaled by S^-1/2 (`query_pre_attn_scalar`; absent: the head width,
  Megatron's 1/sqrt(kv_channels));
- `--output-logit-softcapping C` / `--attn-logit-softcapping C`: C·tanh(x / C) on the logits / attention scores
  (`final_logit_softcapping` / `attn_logit_softcapping`; absent: none, where transformers' defaults are 30 and 50);
- `--interleave-sliding-window W`: layers 1, 3, 5, … (Megatron's 1-based numbering: `is_sliding = not (layer_number
  - 1) % 2`) attend within W tokens, the others to everything — transformers' layer_types with layer 0 sliding
  (`sliding_window` W; absent: every layer full attention);
- `--gelu-tanh`: the gated MLP's tanh-approximated GELU (`hidden_activation` gelu_pytorch_tanh).
With `--load` naming an HF directory, each flag given becomes its key and validation checks it against the
directory's config.json (a `--query-pre-attn-scalar` the checkpoint does not have is an error, not ignored).
"""
from __future__ import annotations

MODEL_TYPE = "gemma2"
# Gemma-2's fixed parts: from scratch the line must say each (HF Gemma-2 always has them)
_ALWAYS = {"post_norm": "a norm after attention and after the MLP (--post-norm)",
           "add_rmsnorm_offset": "RMSNorm scaled by 1 + weight (--add-rmsnorm-offset)",
           "input_embeds_norm": "embeddings scaled by sqrt(hidden size) (--input-embeds-norm)"}


NAMES = {"hidden_act": "hidden_activation"}  # the dense keys' names in Gemma-2's config


def selects_gemma2(ns, active) -> bool:  # noqa: ARG001 — the selectors' signature
    """True when `--model-type-hf gemma2`, MindSpeed's Gemma-2 `--spec`, or `--post-norm` names Gemma-2."""
    if str(getattr(ns, "model_type_hf", None) or "").lower() == MODEL_TYPE:
        return True
    spec = getattr(ns, "spec", None) or []
    if any("gemma2_spec" in str(part) for part in (spec if isinstance(spec, (list, tuple)) else [spec])):
        return True
    return bool(getattr(ns, "post_norm", False))


def gated_activation(a) -> bool:
    """Gemma-2's MLP is gated whatever the activation flag (MindSpeed's scripts give --gelu-tanh alone)."""
    return bool(a.get("gelu_tanh") or a.get("swiglu") or a.get("geglu"))


def apply(a) -> None:
    """Gemma-2's own keys, after the dense ones (which name the activation `hidden_activation`, NAMES)."""
    g = a.get
    head_dim = a.keys.get("head_dim") or g("kv_channels") or (
        g("hidden_size") // g("num_attention_heads") if g("hidden_size") and g("num_attention_heads") else None)
    a.put("query_pre_attn_scalar", "query_pre_attn_scalar",
          g("query_pre_attn_scalar") or (head_dim if a.from_scratch else None))
    a.put("output_logit_softcapping", "final_logit_softcapping", g("output_logit_softcapping"))
    a.put("attn_logit_softcapping", "attn_logit_softcapping", g("attn_logit_softcapping"))
    window = g("interleave_sliding_window")
    a.put("interleave_sliding_window", "sliding_window", window)
    for dest, what in _ALWAYS.items():
        if g(dest):
            a.note(dest, "mapped", f"model.architecture.model_type ({MODEL_TYPE}: {what})")
        elif a.from_scratch:
            a.decline(dest, f"HF Gemma-2 always has {what} — add {'--' + dest.replace('_', '-')}, or give --load "
                            "with an HF directory")
    for dest in ("spec", "model_type_hf"):
        if g(dest):
            a.note(dest, "mapped", f"model.architecture.model_type ({MODEL_TYPE})")
    if not a.from_scratch:
        return
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):  # absent: none (transformers: 30 / 50)
        a.keys.setdefault(key, None)
    layers = g("num_layers") or 0
    a.keys["layer_types"] = ["sliding_attention" if window and i % 2 == 0 else "full_attention"
                             for i in range(layers)]
    a.keys.setdefault("sliding_window", window)
