"""Which architecture flags the chosen HF model type can express, for `megatron_compat.architecture`: from
scratch the flags must describe that model exactly (`check_buildable` declines what differs), and every active
flag no key took gets its honest disposition at the end (`settle`: mapped, no effect, or declined with why).
`flag_vocab`: the vocabulary the flags give, for every family. `a` is the translation's `Arch` (its flags,
`note` and `decline`)."""
from __future__ import annotations

from typing import Optional

from megatron_compat.architecture.flags import (ARCHITECTURE_DESTS, FAMILY_DESTS, HF_DEFINED_DESTS, HF_REASONS,
                                                MLA_ONLY, MOE_ONLY)


# Tokenizers that Megatron builds from --vocab-size; every other one (HF, SentencePiece, GPT-2 BPE, ...) gives the
# vocabulary itself and Megatron pads that (`_vocab_size_with_padding(tokenizer.vocab_size)`), --vocab-size unread.
VOCAB_SIZE_TOKENIZERS = (None, "NullTokenizer", "TikTokenizer", "NullMultimodalTokenizer")


def flag_vocab(a) -> Optional[int]:
    """The vocabulary the flags give (None: the tokenizer's); the engine pads it (make-vocab-size-divisible-by × tp)
    in one place. Every family reads it here (hybrid, mamba too)."""
    padded = a.get("padded_vocab_size")
    if padded:
        # MindSpeed's --padded-vocab-size is the embedding's row count as given (it replaces Megatron's padding of
        # --vocab-size); --vocab-size still sizes a NullTokenizer's vocabulary, which must fit in those rows.
        vocab = a.get("vocab_size")
        if vocab is not None and vocab > padded:
            a.decline("vocab_size", f"{vocab} tokens do not fit in --padded-vocab-size {padded} rows — raise "
                                    "--padded-vocab-size, or drop it (Megatron pads --vocab-size itself)")
        else:
            a.note("vocab_size", "mapped", f"the tokenizer's vocabulary in the --padded-vocab-size {padded} "
                                           "embedding rows (model.architecture.vocab_size)")
        return padded
    if a.get("tokenizer_type") not in VOCAB_SIZE_TOKENIZERS:
        a.note("vocab_size", "no_effect", f"Megatron sizes the vocabulary from the {a.get('tokenizer_type')} "
                                          "tokenizer (padded to --make-vocab-size-divisible-by × TP), as here")
        return None
    return a.get("vocab_size")


def rotary(a) -> bool:
    return a.get("position_embedding_type") == "rope" or bool(a.get("use_rotary_position_embeddings"))


def check_buildable(a, family: str) -> None:
    """From scratch, the flags must describe the chosen HF model type exactly; decline what differs."""
    g = a.get
    rope = rotary(a) or (family == "gpt_oss" and g("position_embedding_type") == "yarn")
    gated = g("swiglu") or g("geglu") or (family == "gpt_oss" and g("quick_geglu"))  # gpt_oss: its own checks
    gated = gated or (family == "gemma2" and g("gelu_tanh"))  # Gemma-2's MLP is gated: MindSpeed gives --gelu-tanh
    if family == "gpt2":
        if g("normalization") != "LayerNorm":
            a.decline("normalization", "RMSNorm with learned absolute positions has no HF model type to build — "
                                       "use --position-embedding-type rope with --swiglu (a Llama-style model)")
        if not g("add_bias_linear"):
            a.decline("add_bias_linear", "a GPT-2-style model without linear biases has no HF model type to "
                                         "build — drop --disable-bias-linear or use a Llama-style model")
        if g("group_query_attention"):
            a.decline("group_query_attention", "GPT-2-style models have no grouped-query attention — use "
                                               "--position-embedding-type rope --swiglu --normalization RMSNorm")
        if g("squared_relu"):
            a.decline("squared_relu", "no buildable HF model type uses squared ReLU — give --load with an HF "
                                      "directory of that model")
        if g("qk_layernorm"):
            a.decline("qk_layernorm", "GPT-2-style models have no QK layernorm — use --position-embedding-type "
                                      "rope --swiglu --normalization RMSNorm (a Qwen3-style model)")
        return
    if family == "qwen2_moe" and not g("add_qkv_bias"):
        a.decline("moe_shared_expert_intermediate_size", "Qwen2-MoE-style models (shared experts) have q/k/v "
                  "biases — add --add-qkv-bias, or give --load with an HF directory")
    if not rope:
        a.decline("position_embedding_type", f"a {family}-style model needs rotary embeddings — use "
                                             "--position-embedding-type rope, or give --load with an HF directory")
    if g("normalization") != "RMSNorm":
        a.decline("normalization", f"a {family}-style model uses RMSNorm — use --normalization RMSNorm, or give "
                                   "--load with an HF directory")
    if not gated:
        a.decline("swiglu", f"a {family}-style model has a gated MLP — add --swiglu, or give --load with an HF "
                            "directory")
    if g("hidden_dropout") and "hidden_dropout" in a.active:  # Megatron's default 0.1: the translation warns
        a.decline("hidden_dropout", f"HF {family} models have no hidden dropout — set --hidden-dropout 0")
    if g("add_bias_linear") and family not in ("llama", "gpt_oss"):
        a.decline("add_bias_linear", f"HF {family} models have no biases on every linear layer (Megatron's "
                                     "default) — add --disable-bias-linear")
    if g("add_qkv_bias") and not g("add_bias_linear") and family not in ("qwen2", "qwen2_moe", "gpt_oss"):
        a.decline("add_qkv_bias", f"HF {family} models put attention biases on q/k/v and o together — drop "
                                  "--add-qkv-bias, or give --load with an HF directory")


def settle(a, family: str) -> None:
    """Every active architecture flag not yet given a disposition gets the honest one."""
    for dest in sorted(set(a.active) - a.recorded):
        if dest in HF_DEFINED_DESTS:
            if a.from_scratch:
                a.decline(dest, "this architecture feature cannot be built from flags — give --load with an HF "
                                "directory of that model")
            else:
                a.note(dest, "no_effect", "defined by the HF model in --load")
        elif dest not in ARCHITECTURE_DESTS or dest in a.declined:
            continue
        elif dest in MOE_ONLY and not a.get("num_experts"):
            a.note(dest, "no_effect", "read only by MoE models (--num-experts)")
        elif dest in MLA_ONLY and family != "deepseek_v3":
            a.note(dest, "no_effect", "read only with --multi-latent-attention")
        elif not a.from_scratch:
            a.note(dest, "no_effect", HF_REASONS.get(dest, "defined by the HF model in --load"))
        elif dest in FAMILY_DESTS:
            a.note(dest, "mapped", f"model.architecture.model_type ({family})")
        elif dest == "hidden_dropout" and not a.get(dest):
            a.note(dest, "no_effect", f"HF {family} models have no hidden dropout, as asked")
        else:
            a.decline(dest, f"not representable in an HF {family} model — drop it, or give --load with an HF "
                            "directory of that model")
