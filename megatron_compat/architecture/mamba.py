"""Megatron / MindSpeed Mamba flags → this project's Mamba-3 model (`model.model_id: mamba3`), from scratch.

When no HF directory or checkpoint defines the model and the script gives Megatron's Mamba mixer flags
(`--mamba-state-dim`, `--mamba-head-dim`, `--mamba-num-groups`, `--mamba-num-heads`) without attention layers
(no `--hybrid-layer-pattern` / `--hybrid-override-pattern` holding anything but Mamba layers "M", no Gated
DeltaNet flags), the flags describe a pure Mamba stack, built as Mamba-3 (the Mamba model this project
implements): `model.model_id mamba3` and these `model.architecture` keys (Megatron's defaults fill the rest):

  --num-layers → num_hidden_layers        --hidden-size → hidden_size          --mamba-state-dim → state_size
  --mamba-head-dim → head_dim             --mamba-num-groups → n_groups        --mamba-num-heads → num_heads
  --mamba-expand → expand (MindSpeed)     --mamba-d-ssm → expand = d_ssm / hidden (must divide)
  --mamba-chunk-size → chunk_size         --norm-epsilon → layer_norm_epsilon  --init-method-std → initializer_range
  --untie-embeddings-and-output-weights → tie_word_embeddings false             --add/--disable-bias-linear → use_bias

`--mamba-d-conv` has no effect (Mamba-3 has no short convolution); attention-only flags (`--num-attention-heads`,
`--max-position-embeddings`, rotary and normalisation choices) have no effect on an attention-free RMSNorm
model and are reported so. Other architecture flags fall to `architecture`'s usual dispositions.
"""
from __future__ import annotations

from typing import Any, Dict

from fsdp2_backend.models.registry import spec_for_model_type
from megatron_compat.architecture.dispositions import flag_vocab
from megatron_compat.architecture.flags import ARCHITECTURE_DESTS, HF_DEFINED_DESTS

SELECTING = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")
GDN = ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
       "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval")
NO_EFFECT = {
    "mamba_d_conv": "Mamba-3 has no short convolution",
    "num_attention_heads": "a pure Mamba-3 stack has no attention layers",
    "group_query_attention": "a pure Mamba-3 stack has no attention layers",
    "num_query_groups": "a pure Mamba-3 stack has no attention layers",
    "kv_channels": "a pure Mamba-3 stack has no attention layers",
    "max_position_embeddings": "Mamba-3 has no position table (its rotary angles are data-dependent)",
    "position_embedding_type": "Mamba-3 has no position embedding (its rotary angles are data-dependent)",
    "use_rotary_position_embeddings": "Mamba-3's rotary angles are data-dependent, not positional",
    "rotary_base": "Mamba-3's rotary angles are data-dependent, not positional",
    "normalization": "Mamba-3 blocks use RMSNorm",
    "attention_dropout": "a pure Mamba-3 stack has no attention layers",
    "hybrid_layer_pattern": "every layer is a Mamba layer",
    "hybrid_override_pattern": "every layer is a Mamba layer",
    "is_hybrid_model": "every layer is a Mamba layer",
}
REQUIRED = ("num_layers", "hidden_size")


def selects_mamba3(ns, active) -> bool:
    """True when the flags describe a pure Mamba stack (see the module docstring)."""
    if not any(dest in active for dest in SELECTING):
        return False
    if any(dest in active for dest in GDN):
        return False
    pattern = getattr(ns, "hybrid_layer_pattern", None) or getattr(ns, "hybrid_override_pattern", None)
    return not pattern or set(str(pattern)) <= {"M"}


def apply(a) -> Dict[str, Any]:
    """Fills `a.keys` for Mamba-3 and gives every active architecture flag its disposition (`a`: an `Arch`)."""
    g = a.get
    a.keys["model_type"] = "mamba3"
    if a._set_field is not None:  # the model is this project's implementation, not a transformers one
        a._set_field(next(d for d in SELECTING if d in a.active), "model.model_id",
                     spec_for_model_type(a.keys["model_type"]).model_id)  # the id building that model type
    a.put("num_layers", "num_hidden_layers", g("num_layers"))
    a.put("hidden_size", "hidden_size", g("hidden_size"))
    a.put("mamba_state_dim", "state_size", g("mamba_state_dim"))
    a.put("mamba_head_dim", "head_dim", g("mamba_head_dim"))
    a.put("mamba_num_groups", "n_groups", g("mamba_num_groups"))
    a.put("mamba_num_heads", "num_heads", g("mamba_num_heads"))
    hidden, d_ssm = g("hidden_size"), g("mamba_d_ssm")
    a.put("mamba_expand", "expand", g("mamba_expand"))
    if d_ssm is not None:
        if not hidden or d_ssm % hidden:
            a.decline("mamba_d_ssm", f"{d_ssm} is not a multiple of --hidden-size {hidden} — Mamba-3 sizes its "
                      f"inner width as expand x hidden; use --mamba-expand")
        elif g("mamba_expand") is not None and g("mamba_expand") != d_ssm // hidden:
            a.decline("mamba_d_ssm", f"{d_ssm} contradicts --mamba-expand {g('mamba_expand')} x --hidden-size "
                      f"{hidden} — give only one of them")
        else:
            a.put("mamba_d_ssm", "expand", d_ssm // hidden)
    a.put("mamba_chunk_size", "chunk_size", g("mamba_chunk_size"))
    eps = g("norm_epsilon") if "norm_epsilon" in a.active else g("layernorm_epsilon")
    a.put("norm_epsilon" if "norm_epsilon" in a.active else "layernorm_epsilon", "layer_norm_epsilon", eps)
    a.put("init_method_std", "initializer_range", g("init_method_std"))
    a.put("untie_embeddings_and_output_weights", "tie_word_embeddings", not g("untie_embeddings_and_output_weights"))
    a.put("add_bias_linear", "use_bias", bool(g("add_bias_linear")))
    vocab = flag_vocab(a)
    if vocab is not None:
        a.put("padded_vocab_size" if g("padded_vocab_size") else "vocab_size", "vocab_size", vocab)
    for dest, why in NO_EFFECT.items():
        if dest not in a.recorded:
            a.note(dest, "no_effect", why)
    for dest in sorted(set(a.active) - a.recorded):
        if dest in ARCHITECTURE_DESTS or dest in HF_DEFINED_DESTS:
            if dest in ("hidden_dropout",) and not g(dest):
                a.note(dest, "no_effect", "Mamba-3 has no hidden dropout, as asked")
            else:
                a.decline(dest, "not representable in this project's Mamba-3 model — drop it, or give --load "
                                "with an HF directory of the model")
    for dest, why in a.declined.items():
        a.note(dest, "declined", why)
    return a.keys
