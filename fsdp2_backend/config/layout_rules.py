"""The rules that tie the parallel layout and the data shape to the model: checked by validation, torch-free.

`check_model_layout(config, facts, world_size, errors)` adds one message per problem:
- tensor parallel: attention heads and key/value heads divisible by tp (`config.tp_cp_checks`);
- context parallel: Ulysses' heads per tp rank divisible by cp (per layer type where a layer type has heads of
  its own: Step-3.5's sliding layers), the sequence cut into cp (Ulysses) or 2 x cp (ring) equal chunks, packed
  documents (reset_attention_mask / reset_position_ids) not in Ulysses' sliding windows, only full-attention layers (and model_id
  qwen3_next's Gated DeltaNet layers: parallel/context_parallel/linear_attention.py; model_id gpt_oss's and
  step35's sliding-window layers: parallel/context_parallel/attention.py; model_id glm52's DSA
  `indexed_attention` layers: parallel/context_parallel/dsa_glm.py, which splits no heads and takes no packed
  documents);
- sequence parallel: the sequence divisible by tp;
- expert parallel: an MoE model whose experts divide by ep; with tp the sequence divisible by tp (the MoE blocks
  run on sequence shards: parallel/moe_tensor_parallel.py);
- model_id mamba3: no tp, no cp (declined with the reason).
- model_id minimax_m27: no tp (q/k RMSNorm over all heads; declined with the reason).
- gpt_oss (model id or model type): no tp (per-head sinks not in the tp plan; declined with the reason).
- model_type nemotron_h (Megatron's hybrid Mamba flags): no tp (no plan for the Mamba mixers).
- model_id step35: no tp (head-wise gate, per-layer head counts; declined with the reason).
- model_id deepseek_v4 under cp: every layer kind (sliding, CSA, HCA: parallel/context_parallel/
  dsa_deepseek_v4.py), no head split (no Ulysses head check), no packed documents.
Facts the model does not state (None) are not checked; the runtime stages then assert.
"""
from __future__ import annotations

from typing import Dict, List

from fsdp2_backend.config.model_facts import ModelFacts
from fsdp2_backend.config.schema import Config
from fsdp2_backend.config.tp_cp_checks import (context_parallel_problems, sequence_length_problems,
                                                 tensor_parallel_problems)

CP_LAYER_TYPES = {"full_attention"}
# model_id deepseek_v4: every layer kind under context parallel (parallel/context_parallel/dsa_deepseek_v4.py)
DEEPSEEK_V4_CP_LAYER_TYPES = {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}


def _prefixed(problems: List[str]) -> List[str]:
    return [p if p.startswith(("parallel.", "data.")) else f"parallel.{p}" for p in problems]


def _own_layer_type_heads(facts: ModelFacts) -> Dict[str, int]:
    """{layer type: query heads} for the layer types whose head count differs from `num_attention_heads`:
    Step-3.5's sliding layers (its config.json's `attention_other_setting`, transformers'
    `num_sliding_attention_heads`)."""
    values = facts.config_json or {}
    sliding = values.get("num_sliding_attention_heads") or (values.get("attention_other_setting") or {}).get(
        "num_attention_heads")
    if sliding and sliding != facts.num_heads and "sliding_attention" in facts.layer_types:
        return {"sliding_attention": sliding}
    return {}


def _ulysses_head_problems(p, facts: ModelFacts) -> List[str]:
    """The cp head checks of every layer type (each named when layer types have their own head counts)."""
    kv_heads = facts.num_kv_heads or facts.num_heads
    own = _own_layer_type_heads(facts)
    by_type = {("full_attention" if own else None): facts.num_heads, **own}
    problems: List[str] = []
    for kind, heads in by_type.items():
        problems += [m for m in context_parallel_problems(p.cp_size, p.cp_type, heads, kv_heads, p.tp_size,
                                                          layer_type=kind) if m not in problems]
    return _prefixed(problems)


def check_model_layout(config: Config, facts: ModelFacts, world_size: int, errors: List[str]) -> None:
    p, d = config.parallel, config.data
    if config.model.model_id == "mamba3" and (p.tp_size > 1 or p.cp_size > 1):
        # the Mamba-3 mixer is not split by heads (TP) and its scan does not pass states between cp ranks (CP)
        which = "tp_size" if p.tp_size > 1 else "cp_size"
        errors.append(f"parallel.{which}: model_id mamba3 runs with FSDP only — tensor and context parallel are "
                      f"not built for its scan; use tp_size 1 and cp_size 1")
        return
    if config.model.model_id == "minimax_m27" and p.tp_size > 1:
        # q/k RMSNorm runs over the whole projection (all heads): a head-sharded norm would need the variance
        # summed over the tp ranks, which is not built
        errors.append("parallel.tp_size: model_id minimax_m27 normalises q and k over all heads at once, which "
                      "tensor parallel would split — use tp_size 1 (FSDP, EP and CP still apply)")
        return
    if (config.model.model_id == "gpt_oss" or facts.model_type == "gpt_oss") and p.tp_size > 1:
        # the per-head sinks (and the stacked experts' biases) are not in the tp plan: a head-sharded attention
        # would pair every rank's heads with all the sinks
        errors.append("parallel.tp_size: gpt_oss's attention sinks (one per head) are not sharded by the "
                      "tensor-parallel plan — use tp_size 1 (FSDP, EP and Ulysses/ring CP apply)")
        return
    if config.model.model_id == "step35" and p.tp_size > 1:
        # the head-wise output gate (g_proj) and the per-layer-type head counts are not in the tp plan
        errors.append("parallel.tp_size: model_id step35 is not built for tensor parallel (its head-wise attention "
                      "gate and per-layer-type head counts are not sharded) — use tp_size 1 (FSDP, EP and CP apply)")
        return
    if facts.model_type == "nemotron_h" and p.tp_size > 1:  # Megatron's hybrid Mamba stack (NemotronH)
        errors.append("parallel.tp_size: model_type nemotron_h (a hybrid Mamba stack) has no tensor-parallel plan "
                      "for its Mamba mixers — use tp_size 1 (FSDP)")
        return
    heads, kv_heads = facts.num_heads, facts.num_kv_heads
    if p.tp_size > 1 and heads:
        errors += _prefixed(tensor_parallel_problems(heads, kv_heads or heads, p.tp_size))
    if p.cp_size > 1:
        dsa = config.model.model_id in ("glm52", "deepseek_v4")
        if heads and not dsa:  # DSA (kvallgather) gathers the keys: no head split
            errors += _ulysses_head_problems(p, facts)
        if dsa and (d.reset_attention_mask or d.reset_position_ids or d.neat_packing):
            errors.append(f"parallel.cp_size: model_id {config.model.model_id}'s context parallel takes no packed "
                          "documents (data.reset_attention_mask / reset_position_ids / neat_packing) — drop them, or "
                          "use cp_size 1")
        errors += [f"data.cutoff_len: {m}" for m in sequence_length_problems(d.cutoff_len, p.cp_size, p.cp_type)]
        if (d.reset_attention_mask or d.reset_position_ids) and p.cp_type == "ulysses" and \
                "sliding_attention" in facts.layer_types:  # packed documents: ring masks windows and documents
            errors.append("parallel.cp_type: packed documents (data.reset_attention_mask / reset_position_ids) in "
                          "sliding-window layers are not built for Ulysses — use cp_type ring, or cp_size 1")
        handled = CP_LAYER_TYPES | ({"linear_attention"} if config.model.model_id == "qwen3_next" else set()) | \
            ({"sliding_attention"} if config.model.model_id in ("gpt_oss", "step35") else set()) | \
            ({"indexed_attention"} if config.model.model_id == "glm52" else set()) | \
            (DEEPSEEK_V4_CP_LAYER_TYPES if config.model.model_id == "deepseek_v4" else set())  # windows (+sinks); DSA
        other = sorted(set(facts.layer_types) - handled)
        if other:
            errors.append(f"parallel.cp_size: layer types {other} of model_type {facts.model_type} are not "
                          f"supported by context parallel — use cp_size 1")
    if p.sequence_parallel and p.tp_size > 1 and d.cutoff_len % p.tp_size:
        errors.append(f"parallel.sequence_parallel: the sequence length {d.cutoff_len} (data.cutoff_len) is not "
                      f"divisible by tp_size {p.tp_size} — use a multiple of {p.tp_size} or drop sequence "
                      f"parallel")
    if p.ep_size > 1 or p.ep_fsdp_size > 1:
        if p.tp_size > 1 and not p.sequence_parallel and d.cutoff_len % p.tp_size:
            # the MoE blocks run on each tp rank's sequence shard (parallel/moe_tensor_parallel.py)
            errors.append(f"parallel.ep_size: with tp_size {p.tp_size} the MoE layers split the sequence "
                          f"{d.cutoff_len} (data.cutoff_len) over the tp ranks — use a multiple of {p.tp_size}")
        if facts.source and not facts.num_experts:
            errors.append(f"parallel.ep_size: the model ({facts.model_type or 'from ' + facts.source}) has no "
                          f"experts — expert parallelism needs an MoE model; use ep_size 1")
        elif facts.num_experts and facts.num_experts % p.ep_size:
            errors.append(f"parallel.ep_size: {p.ep_size} does not divide the model's {facts.num_experts} "
                          f"experts — use a divisor of {facts.num_experts}")
