"""The multi-latent-attention (MLA) and multi-token-prediction (MTP) part of importing a Megatron-LM checkpoint
(`megatron_checkpoint`): the HF DeepSeek-V3 config of a megatron-core MLA GPT, its attention in transformers'
``deepseek_v3`` names, and its MTP layers in this project's ``mtp.layers.{k}.*`` (`fsdp2_backend/models/mtp.py`),
which the HF export writes as DeepSeek-V3's trailing layers (``model.layers.{N + k}``, `mtp_layouts`).

The config comes from the saved ``args`` through the mapping a flags-only run takes
(`megatron_compat.architecture.saved_args`: one place for Megatron's MLA / MoE / YaRN flags → DeepSeek-V3 keys);
here only what that mapping cannot see is checked: what transformers' DeepSeek-V3 computes differently
(declined in one line each) and the MTP depth (``num_nextn_predict_layers``).

Layout facts (megatron-core 0.16.1 ``transformer/multi_latent_attention.py``, ``gpt_layer_specs.py``):

- ``linear_q_down_proj`` [q_lora, H] = ``q_a_proj``; ``linear_q_up_proj`` [heads·(qk + rope), q_lora] = ``q_b_proj``
  (per head the no-rope part, then the rope part, as transformers splits it); without ``--q-lora-rank``
  ``linear_q_proj`` = ``q_proj``. ``linear_kv_down_proj`` [kv_lora + rope, H] = ``kv_a_proj_with_mqa`` (latent,
  then the shared rope key); ``linear_kv_up_proj`` [heads·(qk + v), kv_lora] = ``kv_b_proj``; ``linear_proj`` =
  ``o_proj``.
- The latent norms exist only with ``--qk-layernorm``: ``q_layernorm`` / ``kv_layernorm`` (local spec) or fused as
  ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight`` (Transformer Engine spec). Without
  it the latents are not normalised, which transformers' DeepSeek-V3 (``q_a_layernorm``, ``kv_a_layernorm``
  always applied) cannot express: declined.
- RoPE: megatron-core's MLA de-interleaves the rope channels (even, then odd) before rotating halves
  (``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``), as transformers' DeepSeek-V3 does with
  ``rope_interleave`` (its default): the weights map unpermuted. ``--rotary-interleaved`` is declined upstream.
- The router is ``mlp.router.weight`` (= ``mlp.gate.weight``) and, with ``--moe-router-enable-expert-bias``, the
  buffer ``mlp.router.expert_bias`` (= ``e_score_correction_bias``, `megatron_checkpoint_moe`).
- MTP (``multi_token_prediction.py``): ``mtp.layers.{k}.{enorm, hnorm, eh_proj, final_layernorm}`` and
  ``mtp.layers.{k}.transformer_layer.*`` (a decoder layer of the last main layer's spec), per depth in both
  formats; ``eh_proj`` takes cat(normed embedding, normed hidden) as DeepSeek's and this project's MTP do.

Written here because no library converts Megatron's MLA layout without Megatron-LM itself.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.checkpoint.moe import moe_layer_pattern

_ATTN = "self_attention."


def _arg(args: Any, name: str, default=None):
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def is_mla(args: Any) -> bool:
    return bool(_arg(args, "multi_latent_attention", False))


def _check_routing(args: Any, num_layers: int, first_dense: int) -> None:
    """What transformers' DeepSeek-V3 MoE computes otherwise than megatron-core: declined, one line each."""
    if not _arg(args, "num_experts"):
        return
    flags = ("--moe-router-score-function", "--moe-shared-expert-gate", "--moe-router-num-groups")
    score = _arg(args, "moe_router_score_function", "softmax")
    if score != "sigmoid":
        raise UsageError(f"the Megatron-LM checkpoint's MLA model routes with {flags[0]} {score} — transformers' "
                         f"DeepSeek-V3 scores experts with sigmoid only; not converted")
    if _arg(args, "moe_shared_expert_gate", False):
        raise UsageError(f"the Megatron-LM checkpoint's shared expert is gated ({flags[1]}) — DeepSeek-V3's shared "
                         f"experts have no gate; not converted")
    shared, width = _arg(args, "moe_shared_expert_intermediate_size"), _arg(args, "moe_ffn_hidden_size")
    if shared and width and shared % width:
        raise UsageError(f"the Megatron-LM checkpoint's shared expert ({shared}) is not a whole number of experts of "
                         f"--moe-ffn-hidden-size {width} — DeepSeek-V3 sizes it so; not converted")
    groups, group_topk = int(_arg(args, "moe_router_num_groups", 1) or 1), _arg(args, "moe_router_group_topk")
    if groups > 1 and int(_arg(args, "moe_router_topk", 2)) // int(group_topk or 1) != 2:
        # megatron-core scores a group by its top (topk / group_topk) experts, transformers by its top 2
        raise UsageError(f"the Megatron-LM checkpoint's group-limited routing ({flags[2]} {groups}) scores a group "
                         f"by its top {int(_arg(args, 'moe_router_topk', 2)) // int(group_topk or 1)} experts — "
                         f"transformers' DeepSeek-V3 by its top 2; not converted")
    pattern = moe_layer_pattern(args, num_layers)
    if pattern != [i >= first_dense for i in range(num_layers)]:
        raise UsageError(f"the Megatron-LM checkpoint's dense and MoE layers ({pattern}, --moe-layer-freq) are not "
                         f"dense-first — DeepSeek-V3 has first_k_dense_replace dense layers, then MoE; not converted")


def mla_config(args: Any, state: dict[str, torch.Tensor]):
    """The HF DeepSeek-V3 config of a megatron-core MLA GPT whose saved ``args`` and tensors are given."""
    from transformers import AutoConfig

    from megatron_compat.architecture.saved_args import hf_keys_from_saved_args

    if not any(k.endswith("self_attention.linear_kv_down_proj.weight") for k in state):
        raise UsageError("the Megatron-LM checkpoint's args say multi-latent attention (--multi-latent-attention) "
                         "but its layers hold no MLA projections (linear_kv_down_proj) — args of another run? "
                         "not converted")
    if not _arg(args, "qk_layernorm", False):
        raise UsageError("the Megatron-LM checkpoint's multi-latent attention has no latent norms (trained without "
                         "--qk-layernorm) — transformers' DeepSeek-V3 always normalises the q and kv latents "
                         "(q_a_layernorm, kv_a_layernorm); not converted")
    keys, declined = hf_keys_from_saved_args(args)
    if declined:
        dest, why = declined[0]
        raise UsageError(f"the Megatron-LM checkpoint was trained with --{dest.replace('_', '-')} "
                         f"{getattr(args, dest, None)!r}: {why} — not converted")
    if keys.pop("model_type", None) != "deepseek_v3":
        raise UsageError("the Megatron-LM checkpoint's MLA args describe no DeepSeek-V3-style model; not converted")
    keys.pop("attention_dropout", None)  # the run's own (its flags), as for dense checkpoints: no model fact
    num_layers = int(args.num_layers)
    if not _arg(args, "num_experts"):
        keys["first_k_dense_replace"] = num_layers  # every layer dense
    _check_routing(args, num_layers, int(keys.get("first_k_dense_replace", 0)))
    keys["vocab_size"] = int(state["embedding.word_embeddings.weight"].shape[0])  # the padded vocabulary, as trained
    keys["q_lora_rank"] = _arg(args, "q_lora_rank")  # None: a plain q_proj (transformers' default is a rank)
    keys["attention_bias"] = False
    depth = int(_arg(args, "mtp_num_layers", 0) or 0)
    if depth:
        keys["num_nextn_predict_layers"] = depth  # DeepSeek-V3's MTP depth (its released config's key)
    return AutoConfig.for_model("deepseek_v3", **keys)


def mla_attention_to_hf(layer: dict, prefix: str) -> dict[str, torch.Tensor]:
    """One MLA layer's attention projections and latent norms in transformers' ``self_attn.*`` names (``o_proj``
    is the shared ``linear_proj`` rule of `megatron_checkpoint`)."""
    if any(k.startswith(_ATTN) and k.endswith(".bias") for k in layer):
        raise UsageError("the Megatron-LM checkpoint's MLA projections have biases — DeepSeek-V3's have none")
    out = {}
    names = {"linear_q_down_proj.weight": "q_a_proj.weight", "linear_q_up_proj.weight": "q_b_proj.weight",
             "linear_q_proj.weight": "q_proj.weight", "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
             "linear_kv_up_proj.weight": "kv_b_proj.weight"}
    for ours, theirs in names.items():
        if _ATTN + ours in layer:
            out[f"{prefix}self_attn.{theirs}"] = layer[_ATTN + ours]
    norms = {"q_a_layernorm.weight": ("linear_q_up_proj.layer_norm_weight", "q_layernorm.weight"),
             "kv_a_layernorm.weight": ("linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight")}
    for theirs, candidates in norms.items():
        found = next((layer[_ATTN + c] for c in candidates if _ATTN + c in layer), None)
        if found is None and (theirs.startswith("kv") or _ATTN + "linear_q_up_proj.weight" in layer):
            raise UsageError(f"the Megatron-LM checkpoint's {prefix.replace('model.', 'decoder.')}{_ATTN}"
                             f"{candidates[1]} is missing — an MLA layer without latent norms does not convert")
        if found is not None:
            out[f"{prefix}self_attn.{theirs}"] = found
    return out


def mtp_to_hf(state: dict[str, torch.Tensor], config,
              layer_to_hf: Callable[[dict, str], dict]) -> dict[str, torch.Tensor]:
    """The checkpoint's MTP layers as this project's ``mtp.layers.{k}.*`` (the decoder layer converted by
    ``layer_to_hf(layer, prefix)``, as the main layers); a depth the config does not declare is refused."""
    depth = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    present = sorted({int(k.split(".")[2]) for k in state if k.startswith("mtp.layers.")})
    if present != list(range(depth)):
        raise UsageError(f"the Megatron-LM checkpoint holds MTP layers {present}, its args say --mtp-num-layers "
                         f"{depth} — a checkpoint of another run, or a partial save?")
    out: dict[str, torch.Tensor] = {}
    for k in range(depth):
        p = f"mtp.layers.{k}."
        own = {key[len(p):]: value for key, value in state.items() if key.startswith(p)}
        for part in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            if f"{part}.weight" not in own:
                raise UsageError(f"the Megatron-LM checkpoint's {p}{part}.weight is missing")
            out[f"{p}{part}.weight"] = own[f"{part}.weight"]
        if any(key.startswith("eh_proj.") and key.endswith(".bias") for key in own):
            raise UsageError(f"the Megatron-LM checkpoint's {p}eh_proj has a bias — the MTP layout has none")
        layer = {key[len("transformer_layer."):]: v for key, v in own.items() if key.startswith("transformer_layer.")}
        out.update(layer_to_hf(layer, f"{p}transformer_layer."))
    return out


def attach_mtp_layers(model, config) -> Optional[int]:
    """Adds the MTP depths ``config`` declares to a (meta) HF model, so its state dict names them as the export
    writes them (`fsdp2_backend.models.mtp`); returns the depth (None: none)."""
    depth = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if not depth:
        return None
    from fsdp2_backend.models.mtp import attach_mtp

    attach_mtp(model, depth, seed=0)
    return depth


__all__ = ["is_mla", "mla_config", "mla_attention_to_hf", "mtp_to_hf", "attach_mtp_layers"]
