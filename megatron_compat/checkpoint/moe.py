"""The MoE part of importing a Megatron-LM checkpoint (`megatron_checkpoint`): the HF config of a megatron-core
MoE GPT and its experts, router and shared expert in transformers' Qwen3-MoE / Qwen2-MoE / Mixtral layout.

Which HF model (from the saved ``args``): a shared expert (``--moe-shared-expert-intermediate-size`` with
``--moe-shared-expert-gate``) → Qwen2-MoE (``shared_expert``, ``shared_expert_gate``); else ``--qk-layernorm``
→ Qwen3-MoE; else, every layer MoE → Mixtral. Dense layers (``--moe-layer-freq``: an int ``N`` makes layer
``i`` MoE when ``i % N == 0``, a list is the per-layer pattern, 1 = MoE — megatron-core's
``get_gpt_decoder_layer_specs``; MindSpeed's ``--first-k-dense-replace``) become ``mlp_only_layers`` with
``intermediate_size`` = ``--ffn-hidden-size``. Routing: Megatron's default softmax router (top-k of the logits,
softmax over the k) is transformers' softmax / top-k / renormalise (``norm_topk_prob=True``);
``--moe-router-pre-softmax`` (softmax over all experts, then top-k) is ``norm_topk_prob=False``. Other router
options (sigmoid scores, expert bias, group-limited top-k, a top-k scaling factor, probabilities on the input)
have no counterpart in those HF models: declined with the reason. For an MLA model (DeepSeek-V3, `checkpoint/mla.py`)
the sigmoid router and its expert bias (``mlp.router.expert_bias`` → ``mlp.gate.e_score_correction_bias``) and the
ungated shared experts (``mlp.shared_experts``) map too.

Expert layouts megatron-core writes (0.16.1 ``transformer/moe/experts.py``), all read into one per-expert form
(``mlp.experts.local_experts.{global e}.linear_fc1.weight`` [2F, H] = [gate; up], ``linear_fc2.weight`` [H, F]):

- ``torch_dist``: ``SequentialMLP``, ``TEGroupedMLP`` and the legacy ``GroupedMLP`` all save one global tensor per
  projection, ``...mlp.experts.experts.linear_fc1.weight`` [E, 2F, H] and ``linear_fc2.weight`` [E, H, F] (the
  layer axis first when layers are stacked); with ``singleton_local_shards`` one key per expert,
  ``...mlp.experts.{e}.linear_fc1.weight`` (its gate and up halves possibly as ``weight_w`` / ``weight_v``).
- legacy ``torch`` (each rank's ``state_dict``, local expert indices): ``SequentialMLP``
  ``mlp.experts.local_experts.{l}.linear_fc{1,2}.weight``; ``TEGroupedMLP`` ``mlp.experts.linear_fc1.weight{l}``;
  ``GroupedMLP`` ``mlp.experts.weight1`` [H, E_local·2F] (expert e's fc1 is ``weight1.view(E_local, H, -1)[e]``,
  transposed) and ``weight2`` [E_local·F, H] (``view(E_local, F, H)[e]``, transposed). Expert-parallel ranks are
  ``mp_rank_TT[_PPP]_EEE`` (Megatron-LM's ``get_checkpoint_name``); local expert l of EP rank r is global expert
  ``r · E_local + l``. Under tensor parallelism the per-expert weights then merge as dense ``linear_fc1`` /
  ``linear_fc2`` do.

Written here because no library converts Megatron's expert layouts without Megatron-LM itself.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

from fsdp2_backend.usage_errors import UsageError

_LOCAL = re.compile(r"^(?P<pre>.*\.mlp\.experts\.)local_experts\.(?P<e>\d+)\.(?P<rest>linear_fc[12]\.(?:weight|bias))$")
_TE_GROUPED = re.compile(r"^(?P<pre>.*\.mlp\.experts\.)(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)(?P<e>\d+)$")
_LEGACY_GROUPED = re.compile(r"^(?P<pre>.*\.mlp\.experts\.)weight(?P<n>[12])$")


def _arg(args: Any, name: str, default=None):
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def is_moe(args: Any, state: dict) -> bool:
    return bool(_arg(args, "num_experts")) or any(".router." in k for k in state)


def moe_layer_pattern(args: Any, num_layers: int) -> list[bool]:
    """Which layers are MoE (megatron-core's ``moe_layer_freq`` rule, MindSpeed's ``first_k_dense_replace``)."""
    freq = _arg(args, "moe_layer_freq", 1)
    if isinstance(freq, str):  # Megatron-LM's "([0]*1+[1]*3)" form, when an args namespace kept the string
        freq = [int(x) for x in re.findall(r"\d+", freq)] if not freq.strip().isdigit() else int(freq)
        if isinstance(freq, list):
            raise UsageError(f"the Megatron-LM checkpoint's --moe-layer-freq {_arg(args, 'moe_layer_freq')!r} is "
                             f"an unevaluated expression — give the HF config (--hf-config DIR)")
    if isinstance(freq, int):
        pattern = [i % freq == 0 for i in range(num_layers)]
    else:
        pattern = [bool(x) for x in freq]
    if len(pattern) != num_layers:
        raise UsageError(f"the Megatron-LM checkpoint's --moe-layer-freq has {len(pattern)} entries for "
                         f"{num_layers} layers")
    first_dense = int(_arg(args, "first_k_dense_replace", 0) or 0)
    return [moe and i >= first_dense for i, moe in enumerate(pattern)]


def _aux_coeff(args: Any) -> float:
    """--moe-aux-loss-coeff (nargs='+': Megatron-LM saves a list, one value per --moe-router-load-balancing-type)."""
    value = _arg(args, "moe_aux_loss_coeff", 0.0) or 0.0
    if isinstance(value, (list, tuple)):
        if len(value) > 1:
            raise UsageError(f"the Megatron-LM checkpoint combines several load-balancing losses (--moe-aux-loss-coeff "
                             f"{list(value)}) — the HF MoE layouts have one auxiliary loss; not converted")
        value = value[0] if value else 0.0
    return float(value)


def moe_config(args: Any, fields: dict, qkv_bias: bool):
    """The HF config of a megatron-core MoE GPT: ``fields`` are the dense ones `hf_config_from_args` derived."""
    from transformers import AutoConfig

    unsupported = (("moe_router_score_function", "sigmoid router scores", lambda v: v not in (None, "softmax")),
                   ("moe_router_enable_expert_bias", "an expert bias (aux-loss-free balancing)", bool),
                   ("moe_router_num_groups", "group-limited routing", bool),
                   ("moe_router_topk_scaling_factor", "a top-k scaling factor", lambda v: v not in (None, 1, 1.0)),
                   ("moe_apply_probs_on_input", "routing probabilities applied on the input", bool))
    for name, what, bad in unsupported:
        if bad(_arg(args, name)):
            raise UsageError(f"the Megatron-LM checkpoint's router uses {what} (--{name.replace('_', '-')}) — the "
                             f"Qwen3-MoE / Qwen2-MoE / Mixtral HF layouts route with softmax top-k only; not "
                             f"converted")
    num_layers = fields["num_hidden_layers"]
    pattern = moe_layer_pattern(args, num_layers)
    moe = dict(num_experts=int(args.num_experts), num_experts_per_tok=int(_arg(args, "moe_router_topk", 2)),
               moe_intermediate_size=int(_arg(args, "moe_ffn_hidden_size", fields["intermediate_size"])),
               norm_topk_prob=not _arg(args, "moe_router_pre_softmax", False), decoder_sparse_step=1,
               mlp_only_layers=[i for i, m in enumerate(pattern) if not m], router_aux_loss_coef=_aux_coeff(args))
    shared = _arg(args, "moe_shared_expert_intermediate_size")
    qk_norm = _arg(args, "qk_layernorm", False)
    if shared:
        if not _arg(args, "moe_shared_expert_gate", False) or qk_norm:
            raise UsageError("the Megatron-LM checkpoint has a shared expert " + (
                "and --qk-layernorm" if qk_norm else "without --moe-shared-expert-gate") + " — the HF layout with "
                "a shared expert (Qwen2-MoE) has a gated shared expert and no q/k norms; not converted")
        return AutoConfig.for_model("qwen2_moe", **fields, **moe, shared_expert_intermediate_size=int(shared),
                                    qkv_bias=qkv_bias)
    if qkv_bias:
        raise UsageError("the Megatron-LM checkpoint is MoE with --add-qkv-bias and no shared expert — no HF MoE "
                         "layout here matches it (Qwen2-MoE needs a gated shared expert); not converted")
    if qk_norm:
        return AutoConfig.for_model("qwen3_moe", **fields, **moe)
    if moe["mlp_only_layers"] or not moe["norm_topk_prob"]:
        raise UsageError("the Megatron-LM checkpoint is MoE without --qk-layernorm and with dense layers or "
                         "--moe-router-pre-softmax — the HF layout without q/k norms (Mixtral) has neither; "
                         "not converted")
    mixtral = {k: v for k, v in fields.items() if k != "intermediate_size"}
    return AutoConfig.for_model("mixtral", **mixtral, num_local_experts=moe["num_experts"],
                                num_experts_per_tok=moe["num_experts_per_tok"],
                                intermediate_size=moe["moe_intermediate_size"],
                                router_aux_loss_coef=moe["router_aux_loss_coef"])


def normalize_experts(shard: dict[str, torch.Tensor], ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One legacy rank's state dict with its experts as ``mlp.experts.local_experts.{global e}.linear_fc*`` (the
    SequentialMLP form, global indices), whichever expert module saved them. Tensors are views: meta tensors and
    optimizer moments (the parameters' own shapes) convert the same way."""
    out: dict[str, torch.Tensor] = {}
    for key, value in shard.items():
        match = _LOCAL.match(key) or _TE_GROUPED.match(key)
        if match is not None:
            local = int(match["e"])
            rest = match["rest"] if "rest" in match.groupdict() else f"{match['fc']}.{match['kind']}"
            router = shard.get(match["pre"][:-len("experts.")] + "router.weight")
            num_local = router.shape[0] // ep_size if router is not None else None
            if num_local is None and ep_size > 1:
                raise UsageError(f"{key}: no router weight beside these experts — cannot number them globally")
            out[f"{match['pre']}local_experts.{ep_rank * (num_local or 0) + local}.{rest}"] = value
            continue
        match = _LEGACY_GROUPED.match(key)
        if match is None:
            out[key] = value
            continue
        router = shard[match["pre"][:-len("experts.")] + "router.weight"]
        num_local, hidden = router.shape[0] // ep_size, router.shape[1]
        if match["n"] == "1":  # [H, E_local * 2F] read as [E_local, H, 2F] (GroupedMLP's own view), transposed
            experts = value.reshape(num_local, hidden, -1).transpose(1, 2)
        else:  # [E_local * F, H]: expert e's [F, H] block, transposed to fc2's [H, F]
            experts = value.reshape(num_local, -1, hidden).transpose(1, 2)
        fc = "linear_fc1" if match["n"] == "1" else "linear_fc2"
        for local in range(num_local):
            out[f"{match['pre']}local_experts.{ep_rank * num_local + local}.{fc}.weight"] = experts[local]
    return out


def _stacked_experts(layer: dict, fc: str, num_experts: int) -> Optional[torch.Tensor]:
    """[E, rows, cols] for one projection of a layer's experts, from whichever key form the checkpoint has."""
    whole = layer.get(f"mlp.experts.experts.{fc}.weight")
    if whole is not None:  # torch_dist: one global tensor
        return whole
    per_expert = []
    for e in range(num_experts):
        found = layer.get(f"mlp.experts.local_experts.{e}.{fc}.weight", layer.get(f"mlp.experts.{e}.{fc}.weight"))
        if found is None and f"mlp.experts.{e}.{fc}.weight_w" in layer:  # singleton shards, GLU halves apart
            found = torch.cat([layer[f"mlp.experts.{e}.{fc}.weight_w"], layer[f"mlp.experts.{e}.{fc}.weight_v"]])
        if found is None:
            return None
        per_expert.append(found)
    return torch.stack(per_expert)


def moe_layer_to_hf(layer: dict, prefix: str, config) -> dict[str, torch.Tensor]:
    """One MoE layer's MLP in transformers' in-memory names (``mlp.gate.weight``, stacked
    ``mlp.experts.gate_up_proj`` [E, 2I, H] = per expert [gate; up], ``mlp.experts.down_proj`` [E, H, I], the
    shared expert and its gate); ``save_pretrained`` writes them per expert as the HF checkpoints have them."""
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    if any(k.startswith("mlp.experts.") and k.endswith(".bias") for k in layer) or "mlp.router.bias" in layer:
        raise UsageError("the Megatron-LM checkpoint's experts or router have biases — the HF MoE layouts have none")
    out = {f"{prefix}mlp.gate.weight": layer["mlp.router.weight"]}
    deepseek = getattr(config, "model_type", None) == "deepseek_v3"
    if "mlp.router.expert_bias" in layer and not deepseek:
        raise UsageError("the Megatron-LM checkpoint's router has an expert bias — only the DeepSeek-V3 layout holds "
                         "one (e_score_correction_bias)")
    for fc, name in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
        stacked = _stacked_experts(layer, fc, num_experts)
        if stacked is None or stacked.shape[0] != num_experts:
            raise UsageError(f"the Megatron-LM checkpoint's {prefix.replace('model.', 'decoder.')}mlp.experts lack "
                             f"{fc} weights for {num_experts} experts — a checkpoint written by a partial save?")
        out[f"{prefix}mlp.experts.{name}"] = stacked.contiguous()
    if deepseek:
        out.update(_deepseek_router_and_shared(layer, prefix, num_experts))
    elif getattr(config, "shared_expert_intermediate_size", None):
        gate, up = layer["mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        out.update({f"{prefix}mlp.shared_expert.gate_proj.weight": gate.contiguous(),
                    f"{prefix}mlp.shared_expert.up_proj.weight": up.contiguous(),
                    f"{prefix}mlp.shared_expert.down_proj.weight": layer["mlp.shared_experts.linear_fc2.weight"],
                    f"{prefix}mlp.shared_expert_gate.weight": layer["mlp.shared_experts.gate_weight"]})
    return out


def _deepseek_router_and_shared(layer: dict, prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's expert bias and ungated shared experts: megatron-core's ``mlp.router.expert_bias`` (the
    aux-loss-free balancing bias added to the sigmoid scores for the top-k choice only) is transformers'
    ``mlp.gate.e_score_correction_bias`` (zeros when the run had none: the same choice); ``mlp.shared_experts``'
    fc1 = [gate; up] as a dense MLP's."""
    if "mlp.shared_experts.gate_weight" in layer:
        raise UsageError("the Megatron-LM checkpoint's shared expert is gated (--moe-shared-expert-gate) — "
                         "DeepSeek-V3's shared experts have no gate; not converted")
    bias = layer.get("mlp.router.expert_bias")
    out = {f"{prefix}mlp.gate.e_score_correction_bias": torch.zeros(num_experts) if bias is None else bias}
    if "mlp.shared_experts.linear_fc1.weight" in layer:
        gate, up = layer["mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        out.update({f"{prefix}mlp.shared_experts.gate_proj.weight": gate.contiguous(),
                    f"{prefix}mlp.shared_experts.up_proj.weight": up.contiguous(),
                    f"{prefix}mlp.shared_experts.down_proj.weight": layer["mlp.shared_experts.linear_fc2.weight"]})
    return out


__all__ = ["is_moe", "moe_layer_pattern", "moe_config", "normalize_experts", "moe_layer_to_hf"]
