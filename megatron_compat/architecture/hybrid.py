"""Megatron's hybrid Mamba models (`--hybrid-layer-pattern` / `--hybrid-override-pattern`) → transformers'
NemotronH (`model_type nemotron_h`, `NemotronHForCausalLM`), from scratch.

Megatron-LM's hybrid stack (megatron-core `ssm/mamba_block.py`, `ssm/mamba_hybrid_layer_allocation.py`) builds
one residual pre-norm block per pattern letter: `M` a Mamba-2 mixer (`ssm/mamba_mixer.py`), `*` self-attention
without an MLP, `-` a plain (non-gated) MLP, `E` an MoE layer; `|` separates pipeline stages and `/` starts the
multi-token-prediction part (newer Megatron-LM). NemotronH has the same blocks and letters (its
`hybrid_override_pattern`); the flags map as follows (Megatron's defaults fill what the script leaves out):

  --hybrid-layer-pattern (| removed) → layers_block_type; --num-layers, when given, must equal its length
  --hidden-size, --num-attention-heads, --num-query-groups (with --group-query-attention), --kv-channels → the
      same sizes (head_dim = kv-channels, or hidden / heads); --ffn-hidden-size (default 4 x hidden) →
      intermediate_size; the MLP activation: gelu (Megatron's default), --squared-relu → relu2,
      --openai-gelu → gelu_new; a gated MLP (--swiglu) has no NemotronH counterpart (declined)
  --mamba-state-dim (128) → ssm_state_size      --mamba-head-dim (64) → mamba_head_dim
  --mamba-num-groups (8) → n_groups        --mamba-num-heads → mamba_num_heads, else expand x hidden / head dim
      with Megatron's expand 2 (MindSpeed's --mamba-expand / --mamba-d-ssm when given); conv width 4 (MindSpeed's
      --mamba-d-conv), --mamba-chunk-size → chunk_size (128); conv bias on, no projection biases, dt init range
      [0.001, 0.1] floor 1e-4, no dt limit: time_step_limit (0, inf) — transformers' mixer clamps dt at
      time_step_min instead, which `models/nemotron_h.honour_time_step_limit` corrects on the built model
  --norm-epsilon → layer_norm_epsilon (NemotronH uses it for the Mamba gated norm too, which Megatron fixes at
      1e-5: another value is declined); --normalization must be RMSNorm
  --position-embedding-type none: NemotronH has no position embedding (rope / learned_absolute are declined)
  --init-method-std → initializer_range; --untie-embeddings-and-output-weights → tie_word_embeddings false
  --disable-bias-linear: required (NemotronH's attention has no biases, Megatron's default adds them)

Declined with one line: `E` (MoE) layers and `/` (MTP) in the pattern, qk-layernorm, hidden dropout.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_compat.architecture.dispositions import flag_vocab
from megatron_compat.architecture.flags import ARCHITECTURE_DESTS, HF_DEFINED_DESTS

PATTERN_DESTS = ("hybrid_layer_pattern", "hybrid_override_pattern")
LAYER_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MEGATRON_MIXER_NORM_EPS = 1e-5  # megatron-core MambaMixer's gated RMSNorm: eps fixed at 1e-5
REQUIRED = ("hidden_size", "num_attention_heads")

NO_EFFECT = {
    "is_hybrid_model": "the layer pattern already makes the model hybrid",
    "rotary_base": "NemotronH has no rotary embedding (--position-embedding-type none)",
    "rotary_percent": "NemotronH has no rotary embedding (--position-embedding-type none)",
    "no_enable_linear_qkv": "q/k/v projections are laid out as the HF model's",
}


def pattern_of(ns) -> Optional[str]:
    return getattr(ns, "hybrid_layer_pattern", None) or getattr(ns, "hybrid_override_pattern", None)


def selects_hybrid(ns, active) -> bool:
    """True when a layer pattern with more than Mamba layers describes the model (pure "M" stays mamba3)."""
    pattern = pattern_of(ns)
    return bool(pattern) and not set(str(pattern).replace("|", "")) <= {"M"}


def layer_kinds(pattern: str) -> List[str]:
    """NemotronH's `layers_block_type` for a Megatron pattern (pipeline separators removed)."""
    return [LAYER_KINDS[ch] for ch in pattern.replace("|", "")]


def _pattern_dest(a) -> str:
    return next(d for d in PATTERN_DESTS if a.get(d))


def _mamba_heads(a, hidden: Optional[int], head_dim: int) -> Optional[int]:
    g = a.get
    if g("mamba_num_heads") is not None:
        a.put("mamba_num_heads", "mamba_num_heads", g("mamba_num_heads"))
        for dest in ("mamba_expand", "mamba_d_ssm"):
            a.note(dest, "no_effect", "--mamba-num-heads sets the Mamba inner width, as in Megatron")
        return g("mamba_num_heads")
    if hidden is None:
        return None
    d_inner = g("mamba_d_ssm") or (g("mamba_expand") or 2) * hidden
    dest = "mamba_d_ssm" if g("mamba_d_ssm") else "mamba_expand"
    if d_inner % head_dim:
        a.decline(dest if dest in a.active else "mamba_head_dim",
                  f"the Mamba inner width {d_inner} is not a multiple of --mamba-head-dim {head_dim} — change one")
        return None
    a.put(dest, "mamba_num_heads", d_inner // head_dim)
    return d_inner // head_dim


def _mamba_keys(a, hidden: Optional[int]) -> None:
    g = a.get
    head_dim = g("mamba_head_dim") or 64
    a.put("mamba_state_dim", "ssm_state_size", g("mamba_state_dim") or 128)
    a.put("mamba_head_dim", "mamba_head_dim", head_dim)
    groups = g("mamba_num_groups") or 8
    a.put("mamba_num_groups", "n_groups", groups)
    heads = _mamba_heads(a, hidden, head_dim)
    if heads and heads % groups:
        a.decline("mamba_num_groups", f"{heads} Mamba heads do not split into {groups} groups — change "
                                      "--mamba-num-groups")
    a.put("mamba_d_conv", "conv_kernel", g("mamba_d_conv") or 4)
    a.put("mamba_chunk_size", "chunk_size", g("mamba_chunk_size") or 128)
    for key, value in (("use_conv_bias", True), ("use_bias", False), ("mamba_proj_bias", False),
                       ("time_step_min", 0.001), ("time_step_max", 0.1), ("time_step_floor", 1e-4),
                       ("time_step_limit", [0.0, float("inf")]), ("mamba_hidden_act", "silu"),
                       ("residual_in_fp32", False)):
        a.keys[key] = value
    a.note("use_mamba_mem_eff_path", "no_effect", "a kernel choice; the math is the same")


def _mlp_act(a) -> Optional[str]:
    g = a.get
    if g("swiglu") or g("geglu"):
        a.decline("swiglu" if g("swiglu") else "geglu", "NemotronH's MLP layers are not gated — drop it (Megatron's "
                  "hybrid MLP is then gelu, or --squared-relu), or give --load with an HF directory")
        return None
    if g("squared_relu"):
        return "relu2"
    if g("openai_gelu"):
        return "gelu_new"
    if g("gelu_tanh"):
        return "gelu_pytorch_tanh"
    return "gelu"


def apply(a) -> Dict[str, Any]:
    """Fills `a.keys` for NemotronH and gives every active architecture flag its disposition (`a`: an `Arch`)."""
    g = a.get
    a.keys["model_type"] = "nemotron_h"
    dest = _pattern_dest(a)
    pattern = str(g(dest))
    main, _, mtp = pattern.partition("/")
    bad = sorted(set(main.replace("|", "")) - set(LAYER_KINDS))
    if mtp:
        a.decline(dest, "the multi-token-prediction part of the pattern (after '/') is not built for hybrid "
                        "models — drop it")
    elif bad:
        a.decline(dest, f"{''.join(bad)!r} is not a layer letter (M, *, -, E) — write the pattern "
                  "with M (Mamba), * (attention), - (MLP) and E (MoE)")
    elif "E" in main:
        a.decline(dest, "MoE layers (E) in a hybrid pattern are not built from flags (Megatron's and NemotronH's "
                        "MoE routers differ) — give --load with an HF directory of that model")
    else:
        kinds = layer_kinds(main)
        a.put(dest, "layers_block_type", kinds)
        if g("num_layers") is not None and g("num_layers") != len(kinds):
            flag = "--" + dest.replace("_", "-")
            a.decline("num_layers", f"{g('num_layers')} differs from the {len(kinds)} layers of {flag} — drop "
                                    "--num-layers (the pattern gives the count)")
        else:
            a.note("num_layers", "mapped", "model.architecture.layers_block_type (its length)")
    hidden, heads = g("hidden_size"), g("num_attention_heads")
    a.put("hidden_size", "hidden_size", hidden)
    a.put("num_attention_heads", "num_attention_heads", heads)
    kv = g("num_query_groups") if g("group_query_attention") else heads
    a.put("group_query_attention", "num_key_value_heads", kv)
    a.put("num_query_groups", "num_key_value_heads", kv)
    a.put("kv_channels", "head_dim", g("kv_channels") or (hidden // heads if hidden and heads else None))
    a.put("ffn_hidden_size", "intermediate_size", g("ffn_hidden_size") or (4 * hidden if hidden else None))
    act = _mlp_act(a)
    for flag in ("squared_relu", "openai_gelu", "gelu_tanh"):
        a.put(flag, "mlp_hidden_act", act)
    a.keys["mlp_hidden_act"] = act
    a.put("max_position_embeddings", "max_position_embeddings", g("max_position_embeddings"))
    a.put("attention_dropout", "attention_dropout", g("attention_dropout"))
    a.put("init_method_std", "initializer_range", g("init_method_std"))
    a.put("untie_embeddings_and_output_weights", "tie_word_embeddings", not g("untie_embeddings_and_output_weights"))
    vocab = flag_vocab(a)
    if vocab is not None:
        a.put("padded_vocab_size" if g("padded_vocab_size") else "vocab_size", "vocab_size", vocab)
    eps_dest = "norm_epsilon" if "norm_epsilon" in a.active else "layernorm_epsilon"
    eps = g(eps_dest)
    if eps is not None and eps != MEGATRON_MIXER_NORM_EPS:
        a.decline(eps_dest, f"{eps}: NemotronH uses one epsilon for the block norms and the Mamba gated norm, "
                            f"which Megatron fixes at {MEGATRON_MIXER_NORM_EPS} — use {MEGATRON_MIXER_NORM_EPS}")
    else:
        a.put(eps_dest, "layer_norm_epsilon", MEGATRON_MIXER_NORM_EPS)
    if g("normalization") != "RMSNorm":
        a.decline("normalization", "NemotronH uses RMSNorm — use --normalization RMSNorm")
    else:
        a.note("normalization", "mapped", "model.architecture.model_type (nemotron_h)")
    pos = g("position_embedding_type")
    if pos not in (None, "none") or g("use_rotary_position_embeddings"):
        a.decline("position_embedding_type", f"{pos}: NemotronH's attention has no position embedding — use "
                                             "--position-embedding-type none")
    else:
        a.note("position_embedding_type", "mapped", "model.architecture.model_type (nemotron_h: no position "
                                                    "embedding)")
    if g("add_bias_linear"):
        a.decline("add_bias_linear", "NemotronH has no linear biases (Megatron adds them by default) — add "
                                     "--disable-bias-linear")
    else:
        a.put("add_bias_linear", "mlp_bias", False)
        a.keys["attention_bias"] = False
    if g("add_qkv_bias"):
        a.decline("add_qkv_bias", "NemotronH's attention has no biases — drop it")
    if g("qk_layernorm"):
        a.decline("qk_layernorm", "NemotronH's attention has no q/k norms — drop it")
    if g("hidden_dropout"):
        a.decline("hidden_dropout", "NemotronH has no hidden dropout — set --hidden-dropout 0")
    else:
        a.note("hidden_dropout", "no_effect", "NemotronH has no hidden dropout, as asked")
    _mamba_keys(a, hidden)
    for other in PATTERN_DESTS:
        if other != dest:
            a.note(other, "no_effect", f"--{dest.replace('_', '-')} gives the layers")
    for flag, why in NO_EFFECT.items():
        if flag not in a.recorded:
            a.note(flag, "no_effect", why)
    for flag in sorted(set(a.active) - a.recorded):
        if flag in ARCHITECTURE_DESTS or flag in HF_DEFINED_DESTS:
            if flag not in a.declined:
                a.decline(flag, "not representable in an HF NemotronH model — drop it, or give --load with an HF "
                                "directory of that model")
    for flag, why in a.declined.items():
        a.note(flag, "declined", why)
    return a.keys
