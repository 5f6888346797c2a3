"""Megatron-LM's µP (maximal update parametrisation) on a built transformers model: the model-side parts.

Applied once the model is built and parallelised (`apply_mup`), from `model.use_mup` / `model.mup_*`
(Megatron-LM's `--use-mup`, `--mup-*`; the arithmetic in `config/mup_rules.py`, m = hidden / base hidden):
- attention: each attention module's `scaling` (which transformers' Llama / Qwen2 / Qwen3 / GPT-2 attention
  hands to every attention kernel, and so do this project's packed and context-parallel attentions) becomes
  Megatron's softmax_scale = sqrt(mup_base_head_dim or 1) / head_dim ** mup_attn_scale_power (1/d by default);
- logits × mup_output_mult (1/m unless given): a forward pre-hook multiplies the bias-free lm head's input, since
  W(c·h) = c·(W h). A pre-hook, not an output hook, because the chunked loss swaps the head's forward for one
  returning the loss (training/chunked_forward.py) and still enters through the module's __call__;
- embeddings × mup_embedding_mult: an output hook on every nn.Embedding (token and, for GPT-2, position
  embeddings: Megatron scales their sum);
- initialisation, only for a model initialised from scratch (loaded weights are the weights: µP's init then
  does nothing, said once): every matrix N(0, σ/√m), the output projections (o_proj / down_proj / c_proj)
  N(0, σ/(√(2L)·√m)), the embeddings and an untied output layer keep N(0, σ) (Megatron's
  embedding_init_method); vectors (norms, biases) keep their init. σ = initializer_range (--init-method-std).
  Tensors are drawn whole from a generator seeded with `seed` and each rank keeps its shard, so the weights do
  not depend on the sharding.
The optimizer's µP rules (Adam lr, min_lr and eps ÷ m for matrices outside the embeddings / output layer) are in
`training/optimizer.py`; `embedding_params` is the split they share with the init here.
"""
from __future__ import annotations

import math
from typing import Any, Set

import torch
from torch import nn

from fsdp2_backend.usage_errors import UsageError

# Megatron's output_layer_init_method targets (linear_proj, linear_fc2) under HF names.
OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "attn.c_proj.weight", "mlp.c_proj.weight")


def embedding_params(model: nn.Module) -> Set[int]:
    """ids of Megatron's µP `is_embedding_parameter`s: every embedding table (token, position) and the output
    layer's weight (tied or not)."""
    ids = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        ids.add(id(head.weight))
    return ids


def hidden_matrix_names(model: nn.Module) -> list:
    """Names of the parameters µP treats as hidden matrices (Megatron's non-vector-like, non-embedding ones)."""
    skip = embedding_params(model)
    return [n for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in skip]


def attention_modules(model: nn.Module) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "scaling")
            and hasattr(m, "head_dim")]


def apply_mup(model: nn.Module, model_args: Any, hf_config: Any, *, seed: int, initialise: bool) -> None:
    """Sets µP's attention scale, logit and embedding multipliers and (when `initialise`) its init on `model`."""
    if not model_args.use_mup:
        return
    from fsdp2_backend.config.mup_rules import output_mult, softmax_scale, width_mult

    hidden = hf_config.hidden_size
    attentions = attention_modules(model)
    if not attentions:
        raise UsageError(f"model.use_mup (--use-mup): {type(model).__name__} has no attention module with a "
                         "settable softmax scale — drop --use-mup")
    for module in attentions:
        module.scaling = softmax_scale(model_args, module.head_dim)
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise UsageError("model.use_mup (--use-mup): µP's logit multiplier needs a bias-free output layer — drop "
                         "--use-mup")
    c = output_mult(model_args, hidden)
    if c != 1.0:
        head.register_forward_pre_hook(lambda _m, args: (args[0] * c,) + tuple(args[1:]))
    if model_args.mup_embedding_mult != 1.0:
        e = model_args.mup_embedding_mult
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.register_forward_hook(lambda _m, _args, out: out * e)
    if initialise:
        mup_initialize(model, hf_config.initializer_range, hf_config.num_hidden_layers, width_mult(model_args, hidden),
                       seed)
    else:
        from fsdp2_backend.distributed.console import print_rank0

        print_rank0("notice: model.use_mup: the weights are loaded, so µP's initialisation does nothing (the "
                    "attention scale, multipliers and learning-rate rules apply)")


@torch.no_grad()
def mup_initialize(model: nn.Module, sigma: float, num_layers: int, m: float, seed: int) -> None:
    """Megatron's µP init of every matrix of `model` (see the module docstring), written shard-wise."""
    from fsdp2_backend.models.loading import _assign_full

    embeddings = embedding_params(model)
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        if id(p) in embeddings:
            std = sigma
        elif name.endswith(OUTPUT_PROJECTIONS):
            std = sigma / (math.sqrt(2.0 * num_layers) * math.sqrt(m))
        else:
            std = sigma / math.sqrt(m)
        full = torch.empty(tuple(p.shape), dtype=torch.float32).normal_(0.0, std, generator=generator)
        _assign_full(p, full)
