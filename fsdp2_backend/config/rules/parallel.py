"""Rules of the `parallel.*` layout against the model and the data shape. Torch-free; called once from `validation`; its
parts, in order:

The rules that tie the parallel layout and the data shape to the model: checked by validation, torch-free.

`check_model_layout(config, facts, world_size, errors)` adds one message per problem:
- tensor parallel: attention heads and key/value heads divisible by tp (`config.tp_cp_checks`);
- context parallel: Ulysses' heads per tp rank divisible by cp (per layer type where a layer type has heads of
  its own: Step-3.5's sliding layers), the sequence cut into cp (Ulysses) or 2 x cp (ring) equal chunks, packed
  documents (reset_attention_mask / reset_position_ids) not in Ulysses' sliding windows, only the layer types the
  model id's context parallel handles (full attention without an id);
- sequence parallel: the sequence divisible by tp;
- expert parallel: an MoE model whose experts divide by ep; with tp the sequence divisible by tp (the MoE blocks
  run on sequence shards: parallel/moe_tensor_parallel.py);
- what the model id's spec (`models/<id>/spec.py`) declines, with its reason: tensor parallel (`tp`), context
  parallel kinds (`cp_kinds`), packed documents under context parallel (`cp_packed_documents`); the Ulysses head
  check only where its context parallel splits heads (`cp_splits_heads`). A spec with
  `declines_transformers_model` declines the same for transformers' model of its type (gpt_oss's sinks).
- model_type nemotron_h (Megatron's hybrid Mamba flags): no tp (no plan for the Mamba mixers).
Facts the model does not state (None) are not checked; the runtime stages then assert.
"""
from __future__ import annotations

from typing import Dict, List

from fsdp2_backend.config.model_facts import ModelFacts
from fsdp2_backend.config.schema import Config
from fsdp2_backend.config.tp_cp_checks import (context_parallel_problems, sequence_length_problems,
                                                 tensor_parallel_problems)
from fsdp2_backend.models.registry import spec_for_model_type, spec_of


# --- layout ----------------------------------------------------------------------------------------

CP_LAYER_TYPES = {"full_attention"}  # without a model id


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
    spec = spec_of(config.model.model_id)
    typed = spec_for_model_type(facts.model_type)
    for declining in (spec, typed if typed is not None and typed.declines_transformers_model else None):
        if declining is not None and p.tp_size > 1 and not declining.tp:
            errors.append(declining.note("tp", which="tp_size"))
            return
        if declining is not None and p.cp_size > 1 and p.cp_type not in declining.cp_kinds:
            errors.append(declining.note("cp", which="cp_size", cp_type=p.cp_type))
            return
    if facts.model_type == "nemotron_h" and p.tp_size > 1:  # Megatron's hybrid Mamba stack (NemotronH)
        errors.append("parallel.tp_size: model_type nemotron_h (a hybrid Mamba stack) has no tensor-parallel plan "
                      "for its Mamba mixers — use tp_size 1 (FSDP)")
        return
    heads, kv_heads = facts.num_heads, facts.num_kv_heads
    if p.tp_size > 1 and heads:
        errors += _prefixed(tensor_parallel_problems(heads, kv_heads or heads, p.tp_size))
    if p.cp_size > 1:
        if heads and (spec is None or spec.cp_splits_heads):  # DSA (kvallgather) gathers the keys: no head split
            errors += _ulysses_head_problems(p, facts)
        if spec and not spec.cp_packed_documents and (d.reset_attention_mask or d.reset_position_ids or
                                                      d.neat_packing):
            errors.append(f"parallel.cp_size: model_id {config.model.model_id}'s context parallel takes no packed "
                          "documents (data.reset_attention_mask / reset_position_ids / neat_packing) — drop them, or "
                          "use cp_size 1")
        errors += [f"data.cutoff_len: {m}" for m in sequence_length_problems(d.cutoff_len, p.cp_size, p.cp_type)]
        if (d.reset_attention_mask or d.reset_position_ids) and p.cp_type == "ulysses" and \
                "sliding_attention" in facts.layer_types:  # packed documents: ring masks windows and documents
            errors.append("parallel.cp_type: packed documents (data.reset_attention_mask / reset_position_ids) in "
                          "sliding-window layers are not built for Ulysses — use cp_type ring, or cp_size 1")
        handled = CP_LAYER_TYPES | (spec.cp_layer_types if spec else set())  # the id's context parallel
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
