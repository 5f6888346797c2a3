"""Model FLOPs for the log line's throughput (MindSpeed `training.log_throughput`, Megatron `--log-throughput`).

`model_flops_per_token(hf_config, seq_length)` is the training FLOPs (forward + backward) per token of a
decoder-only transformer, read from its HF config (a `PretrainedConfig` or its config.json dict). It follows
Megatron-LM's `num_floating_point_operations` (megatron/training/training.py, `transformer_flops`) for a BSHD
batch of full `seq_length` samples: Megatron's figure for one iteration is
`model_flops_per_token(...) * global_batch_size * seq_length`.

Per token, with 3x for forward + backward (dgrad and wgrad) and 2 FLOPs per multiply-add:

    6 * H * (f * ffn * dense_layers + f * (moe_ffn * top_k + shared_ffn) * moe_layers)   MLP / experts
  + 6 * L * (H * (q + 2 * kv) + q * H)                                                   QKV + output proj
  + 6 * L * q * seq_length                         core attention: QK^T and AV, halved by the causal mask
  + 6 * H * V                                                                            logits

H hidden_size, L num_hidden_layers, q = heads * head_dim, kv = kv_heads * head_dim, f = 3 for a gated MLP
(gate, up, down; Megatron's swiglu) and 2 otherwise, V vocab_size. Only the `top_k` routed experts a token
is sent to count (plus shared experts); DeepSeek-style multi-latent attention (`kv_lora_rank`) uses
Megatron's MLA terms. For a dense GPT-3 config (f = 2, ffn = 4H, MHA) this is Megatron's
`72 B s L H^2 (1 + s / (12 H) + V / (12 H L))` divided by the batch's `B s` tokens.

Where this differs from Megatron:
  - V is the model's `vocab_size` (the embedding's real size); Megatron uses `padded_vocab_size`, the
    tokenizer's vocabulary padded to a multiple of 128 * TP. Pass a config with the padded size to match.
  - The layer pattern of an MoE model comes from the HF config (`decoder_sparse_step` / `mlp_only_layers`
    for Qwen MoE, `first_k_dense_replace` / `moe_layer_freq` for DeepSeek) instead of `--moe-layer-freq`.
  - Not modelled, as in Megatron: the router (gate) matmul, norms, rotary embeddings, softmax, the
    embedding lookup. Not modelled unlike Megatron: MTP layers, the attention output gate. Sliding-window
    attention is counted as full causal attention (Megatron too).
  - Gated DeltaNet layers (HF `layer_types` "linear_attention", Qwen3-Next) and Mamba-2 layers take
    Megatron's `gdn_layer_flops` / `mamba_layer_flops` terms in place of the attention terms.
  - Packed / variable-length sequences: the core-attention term assumes every sample is `seq_length` long
    (Megatron's BSHD default), which overcounts packed documents under a per-document mask.

MindSpeed-LLM's FSDP2 `FlopsCounter` (qwen3 / qwen3_moe only) differs from both: it counts the attention
score and context matmuls without the causal halving (12 * sum(s^2) * heads * head_dim * L), the embedding
as a second vocab matmul (6 * 2 * V * H) and the MoE router (6 * H * num_experts per layer).

`peak_device_flops(device)` is the dense BF16 peak of a known accelerator (None on CPU or when unknown), for
model FLOPs utilisation. Importing this module does not import torch.
"""
from __future__ import annotations

import re
from typing import Any, Optional

_MISSING = object()


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key, _MISSING) if isinstance(config, dict) else getattr(config, key, _MISSING)
    return default if value is _MISSING or value is None else value


def _text_config(config: Any) -> Any:
    """The language model's config of a composite (e.g. vision-language) config, else the config itself."""
    if _get(config, "hidden_size") is None and _get(config, "text_config") is not None:
        return _get(config, "text_config")
    return config


def _require(config: Any, key: str) -> int:
    value = _get(config, key)
    if value is None:
        raise ValueError(f"model_flops_per_token: the model config has no '{key}' (a decoder-only transformer's "
                         "HF config is needed: hidden_size, num_hidden_layers, num_attention_heads, "
                         "intermediate_size, vocab_size)")
    return int(value)


def _moe_layers(config: Any, num_layers: int) -> int:
    """How many of the decoder layers have a routed-expert MLP (the others have the dense MLP)."""
    if _get(config, "first_k_dense_replace") is not None or _get(config, "n_routed_experts") is not None:
        first_dense, freq = int(_get(config, "first_k_dense_replace", 0)), int(_get(config, "moe_layer_freq", 1))
        return sum(1 for i in range(num_layers) if i >= first_dense and i % max(freq, 1) == 0)
    step = int(_get(config, "decoder_sparse_step", 1))
    dense_only = set(_get(config, "mlp_only_layers", ()) or ())
    return sum(1 for i in range(num_layers) if i not in dense_only and (i + 1) % max(step, 1) == 0)


def model_flops_per_token(hf_config: Any, seq_length: int, *, gated_mlp: bool = True) -> float:
    """Training FLOPs (forward + backward) per token of a decoder-only transformer, Megatron's formula.

    `hf_config`: a transformers `PretrainedConfig` or a config.json dict; `seq_length`: the sample length the
    causal attention spans (the run's sequence length). `gated_mlp=False` counts a plain two-matmul MLP
    (GPT-2 / GPT-3 style); HF's Llama / Qwen / Mistral / DeepSeek MLPs are gated (gate, up, down).
    """
    config = _text_config(hf_config)
    hidden = _require(config, "hidden_size")
    layers = _require(config, "num_hidden_layers")
    # a pure Mamba model has no attention heads (its attention terms are then unused)
    heads = int(_get(config, "num_attention_heads", 1)) if str(_get(config, "model_type", "")).startswith("mamba") \
        else _require(config, "num_attention_heads")
    vocab = _require(config, "vocab_size")
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    head_dim = int(_get(config, "head_dim", hidden // heads))
    mlp_matmuls = 3 if gated_mlp else 2
    fwd_bwd_fma = 3 * 2  # forward, backward dgrad and wgrad; 2 FLOPs per multiply-add

    # MLP: dense layers and (routed top-k + shared) experts of MoE layers.
    num_experts = _get(config, "num_experts", _get(config, "n_routed_experts", _get(config, "num_local_experts", 0)))
    if num_experts and int(num_experts) > 0:
        top_k = int(_get(config, "num_experts_per_tok", _get(config, "experts_per_token", 1)))
        moe_layers = _moe_layers(config, layers)
        expert_ffn = int(_get(config, "moe_intermediate_size", _get(config, "intermediate_size", 0)))
        shared_ffn = int(_get(config, "shared_expert_intermediate_size", 0))
        if _get(config, "n_shared_experts"):
            shared_ffn += int(_get(config, "n_shared_experts")) * expert_ffn
    else:
        top_k = moe_layers = expert_ffn = shared_ffn = 0
    dense_layers = layers - moe_layers
    if str(_get(config, "model_type", "")).startswith("mamba"):
        dense_layers = 0  # a Mamba block has no MLP
    dense_ffn = int(_get(config, "intermediate_size", 0)) if dense_layers else 0
    if dense_layers and not dense_ffn:
        raise ValueError("model_flops_per_token: the model config has no 'intermediate_size'")
    mlp = fwd_bwd_fma * hidden * mlp_matmuls * (dense_ffn * dense_layers + (expert_ffn * top_k + shared_ffn)
                                                * moe_layers)

    # Self attention: token-linear projections and the causal core (L^2) part.
    kv_lora_rank = _get(config, "kv_lora_rank")
    if kv_lora_rank:  # multi-latent attention (DeepSeek V2 / V3), Megatron's MLA branch
        qk_nope, qk_rope = int(_get(config, "qk_nope_head_dim")), int(_get(config, "qk_rope_head_dim"))
        v_head = int(_get(config, "v_head_dim"))
        q_lora_rank = _get(config, "q_lora_rank")
        q_term = (hidden * heads * (qk_nope + qk_rope) if not q_lora_rank
                  else int(q_lora_rank) * (hidden + heads * (qk_nope + qk_rope) + 1))
        attn_linear = fwd_bwd_fma * (q_term + int(kv_lora_rank) * (hidden + heads * (qk_nope + v_head) + 1)
                                     + hidden * qk_rope + heads * v_head * hidden)
        attn_core = fwd_bwd_fma * (heads * (qk_nope + qk_rope) / 2 + heads * v_head / 2)
    else:
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        attn_linear = fwd_bwd_fma * (hidden * (q_size + 2 * kv_size) + q_size * hidden)
        attn_core = fwd_bwd_fma * q_size / 2 * 2  # causal mask halves QK^T and AV; two matmuls
    attention_layers, gdn_layers, mamba_layers = _mixer_layers(config, layers)
    attention = attention_layers * (attn_linear + attn_core * seq_length)
    attention += gdn_layers * _gdn_flops(config, hidden) + mamba_layers * _mamba_flops(config, hidden)

    logits = fwd_bwd_fma * hidden * vocab
    return float(mlp + attention + logits)


def _mixer_layers(config: Any, layers: int):
    """(softmax attention, Gated DeltaNet, Mamba) layer counts: HF `layer_types` ("full_attention" /
    "linear_attention", Qwen3-Next), `layers_block_type` ("attention" / "mamba", hybrid models), or all Mamba for
    a Mamba model."""
    if str(_get(config, "model_type", "")).startswith("mamba"):
        return 0, 0, layers
    kinds = list(_get(config, "layer_types", None) or _get(config, "layers_block_type", None) or [])
    if not kinds:
        return layers, 0, 0
    return (sum(k in ("full_attention", "attention", "sliding_attention") for k in kinds),
            sum(k == "linear_attention" for k in kinds), sum(k == "mamba" for k in kinds))


def _gdn_flops(config: Any, hidden: int) -> float:
    """Training FLOPs per token of one Gated DeltaNet layer (Megatron's `gdn_layer_flops`, x3 for fwd+bwd): the
    in-projection to q, k, v, z and the b, a gates, the short convolution over q, k, v, the delta rule's state
    updates (4 x heads x v_head_dim^2 multiply-adds) and the out-projection."""
    qk_heads, qk_dim = int(_get(config, "linear_num_key_heads", 16)), int(_get(config, "linear_key_head_dim", 128))
    v_heads, v_dim = int(_get(config, "linear_num_value_heads", 32)), int(_get(config, "linear_value_head_dim", 128))
    conv = int(_get(config, "linear_conv_kernel_dim", 4))
    qk, v = qk_heads * qk_dim, v_heads * v_dim
    per_token = (hidden * (2 * qk + 2 * v + 2 * v_heads) + conv * (2 * qk + v) + v_heads * v_dim ** 2 * 4
                 + hidden * v)
    return 3 * 2 * per_token


def _mamba_flops(config: Any, hidden: int) -> float:
    """Training FLOPs per token of one Mamba-2 layer (Megatron's `mamba_layer_flops`, x3 for fwd+bwd): the
    in-projection (x, z, B, C, dt), the selective scan (7 x d_inner x state FLOPs, Megatron's estimate) and the
    out-projection; d_inner = expand x hidden from the config (Megatron assumes expand 2)."""
    d_inner = int(_get(config, "expand", 2)) * hidden
    state, groups = int(_get(config, "state_size", 128)), int(_get(config, "n_groups", 1))
    heads = int(_get(config, "num_heads", 0)) or d_inner // int(_get(config, "head_dim", 64))
    forward = 2 * hidden * (2 * d_inner + 2 * groups * state + heads) + 7 * d_inner * state + 2 * d_inner * hidden
    return 3 * forward


# Dense (no sparsity) BF16 tensor-core peak per device, FLOP/s; the first pattern that matches the name wins.
_PEAK_BF16_FLOPS = (
    (r"GB200", 2500e12), (r"B200", 2250e12), (r"B100", 1750e12),
    (r"H100.*PCIE", 756e12), (r"H100.*NVL", 835e12), (r"H100", 989e12), (r"H200", 989e12),
    (r"H800.*PCIE", 756e12), (r"H800", 989e12), (r"H20\b", 148e12),
    (r"A100", 312e12), (r"A800", 312e12),
    (r"L40S", 362e12), (r"L40", 181e12), (r"L20\b", 119.5e12), (r"\bL4\b", 121e12),
    (r"910B", 354e12),  # Ascend 910B, MindSpeed-LLM's figure
    # Ascend A3 (910C): torch_npu shows each of the package's two dies as a device ("Ascend910_93xx"); an
    # estimate, half of the ~752 TFLOP/s FP16 reported for the package.
    (r"910_93", 376e12),
)


def peak_device_flops_for_name(name: str) -> Optional[float]:
    """The dense BF16 peak FLOP/s of the accelerator called `name` (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    upper = name.upper()
    for pattern, flops in _PEAK_BF16_FLOPS:
        if re.search(pattern, upper):
            return flops
    return None


def peak_device_flops(device: Any) -> Optional[float]:
    """The dense BF16 peak FLOP/s of `device` (a torch.device or its string), or None on CPU / when unknown."""
    import torch  # only here: the module itself stays torch-free

    try:
        device = torch.device(device)
        if device.type == "cpu":
            return None
        name = getattr(torch, device.type).get_device_name(device)  # torch.cuda / torch.npu
    except Exception:  # noqa: BLE001 - no such backend or device here: the peak is unknown
        return None
    return peak_device_flops_for_name(str(name))
