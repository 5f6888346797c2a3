"""Hooks our context-parallel attention into Hugging Face models through transformers' AttentionInterface.

HF attention modules compute q/k/v (with RoPE from the per-shard `position_ids`) and then call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`. `enable_context_parallel`
registers one function under `ATTENTION_NAME`, switches the model to it, and attaches a `ContextParallelSpec`
(the cp group, the algorithm, the attention the model used before) to every attention module — the model code
stays untouched and no state is global: the function reads the spec from the module it is called with.
Ulysses wraps the model's previous attention (eager is run as SDPA: the same math, and it needs no mask);
ring uses `ring.ring_attention`. Sliding-window layers and attention sinks (gpt_oss, `s_aux`): Ulysses hands
both to the sink attention (`kernels.sink_attention`, which builds the window over the gathered sequence) with
the sinks of this rank's heads — also the windows of an eager/SDPA model (step35; no sinks: the SDPA maths with
the window); ring masks the window by global positions and merges the sinks last. Ulysses splits every layer's
own heads: a model whose layer types have their own head counts (step35) is checked per layer type.
Packed documents (position ids restarting at each document: reset_position_ids, neat_packing): Ulysses gathers
the whole sequence's position ids and runs an eager/SDPA model's attention as the packed attention
(`models/packed_attention.py`, per document); ring masks its blocks by document (`ring.py`). Sliding windows
over packed documents are ring's only (the sink attention takes no documents).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.models.packed_attention import PACKED_ATTENTION
from fsdp2_backend.kernels.sink_attention import transformers_sink_attention
from fsdp2_backend.kernels.varlen import is_packed
from fsdp2_backend.parallel.context_parallel.batch import OncePerTensor
from fsdp2_backend.parallel.context_parallel.ring import ring_attention
from fsdp2_backend.parallel.context_parallel.ulysses import heads_to_seq, replicate_kv_heads, seq_to_heads
from fsdp2_backend.config.tp_cp_checks import context_parallel_problems, normalize_cp_type

ATTENTION_NAME = "fsdp2_context_parallel"
SPEC_ATTRIBUTE = "context_parallel_spec"
_SUPPORTED_LAYER_TYPES = {"full_attention"}
_SINK_ATTENTION = "sink_attention"  # kernels.sink_attention's name: takes the sinks and the window
_SDPA_FAMILY = ("eager", "sdpa", None)  # Ulysses runs these as SDPA; a window then goes to the sink attention
_FULL_POSITIONS = OncePerTensor()  # Ulysses: the whole sequence's position ids, gathered once per forward
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class ContextParallelSpec:
    """What the registered attention function needs to know, attached to each attention module."""

    group: dist.ProcessGroup
    cp_type: str  # "ulysses" | "ring"
    inner_attention: str  # the model's attention implementation before CP (used by Ulysses)


class _LocalHeadsView:
    """The attention module as the inner attention should see it after Ulysses' head split.

    Inner HF attention functions read `module.num_key_value_groups` to expand GQA heads; after the split the
    ratio of local query to key/value heads can differ from the module's (when kv heads were repeated).
    """

    def __init__(self, module: nn.Module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = True

    def __getattr__(self, name):
        return getattr(self._module, name)


def _inner_attention(name: str) -> Callable:
    if name in ("eager", "sdpa", None):
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                               dropout: float = 0.0, sliding_window: Optional[int] = None, **kwargs):
    """The function registered as `ATTENTION_NAME`; q [b, h, s_local, d], k/v [b, hkv, s_local, d]."""
    spec: Optional[ContextParallelSpec] = getattr(module, SPEC_ATTRIBUTE, None)
    if spec is None:
        raise RuntimeError(f"{type(module).__name__} has no {SPEC_ATTRIBUTE}: call enable_context_parallel")
    if attention_mask is not None:
        raise UsageError("attention_mask: padding or packed-document masks are not supported with context "
                         "parallel — train on full, unpadded sequences (no reset_attention_mask) with cp_size > 1")
    sinks = kwargs.pop("s_aux", None)
    inner_name = spec.inner_attention
    if sliding_window is not None and inner_name in _SDPA_FAMILY:
        inner_name = _SINK_ATTENTION  # SDPA with the window over the gathered sequence (no sinks: a -inf column)
    if (sliding_window is not None or sinks is not None) and spec.cp_type == "ulysses" and \
            inner_name != _SINK_ATTENTION:
        raise UsageError(f"context parallel: sliding-window layers / attention sinks under Ulysses need the sink "
                         f"attention (model_id gpt_oss) or SDPA/eager, not {spec.inner_attention!r} — use cp_type "
                         "ring, or cp_size 1")
    if dropout:
        raise UsageError("attention_dropout: must be 0 with context parallel — set it to 0")
    if any(kwargs.get(name) is not None for name in _PACKING_KWARGS):
        raise UsageError("context parallel: packed documents given as cu_seq_lens are not supported with cp_size > 1 "
                         "— mark them by restarting position ids (--reset-position-ids, data.neat_packing), or use "
                         "cp_size 1")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if spec.cp_type == "ring":
        return ring_attention(query, key, value, scale, spec.group, sinks, sliding_window,
                              position_ids=kwargs.get("position_ids")).transpose(1, 2), None
    cp = dist.get_world_size(spec.group)
    query = seq_to_heads(query, spec.group)
    key = seq_to_heads(replicate_kv_heads(key, cp), spec.group)
    value = seq_to_heads(replicate_kv_heads(value, cp), spec.group)
    # Positions are already in q/k (RoPE) and the gathered sequence is contiguous: this shard's position_ids must
    # not reach the inner function (flash attention would read them as document boundaries). Packed rows
    # (neat_packing, reset_position_ids): the whole sequence's position ids, gathered on every rank (a shard may
    # hold no restart while another does), are the document boundaries: eager/SDPA models then run the packed
    # attention (per document), flash attention reads them itself.
    shard_positions = kwargs.pop("position_ids", None)
    if shard_positions is not None:
        full_positions = _FULL_POSITIONS(
            shard_positions, (id(spec.group), query.shape[0]),
            lambda: _gather_sequence(shard_positions.expand(query.shape[0], -1).contiguous(), spec.group))
        if spec.inner_attention == PACKED_ATTENTION:
            kwargs["position_ids"] = full_positions
        elif is_packed(full_positions):
            if inner_name in _SDPA_FAMILY:
                inner_name = PACKED_ATTENTION
            elif not str(inner_name).startswith("flash_attention"):
                raise UsageError(f"context parallel: packed documents (restarting position_ids) are not built for "
                                 f"the {inner_name!r} attention under Ulysses — use cp_type ring, or cp_size 1")
            kwargs["position_ids"] = full_positions
    view = _LocalHeadsView(module, query.shape[1] // key.shape[1])
    if inner_name == _SINK_ATTENTION:  # this rank's heads: chunk `rank` of the heads, as seq_to_heads
        heads, rank = query.shape[1], dist.get_rank(spec.group)
        kwargs.update(sliding_window=sliding_window,
                      s_aux=None if sinks is None else sinks[rank * heads:(rank + 1) * heads])
    inner = transformers_sink_attention if inner_name == _SINK_ATTENTION else _inner_attention(inner_name)
    out, _ = inner(view, query, key, value, None, dropout=0.0, scaling=scale, is_causal=True, **kwargs)
    return heads_to_seq(out, spec.group), None


def _gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s_local] pieces of the cp ranks (Ulysses: contiguous slices in rank order) → [b, s]."""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard, group=group)
    return torch.cat(pieces, dim=1)


AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)


def _attention_modules(model: nn.Module):
    """Modules that call the attention interface: HF names them `*Attention` and gives them `layer_idx`."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def _head_counts(config):
    """{(layer type, query heads, key/value heads)}: one entry with no layer type, or, for a config whose head
    counts vary per layer (transformers' heterogeneous `per_layer_config`: step35's sliding layers), one per
    layer type."""
    if not getattr(config, "is_heterogeneous", False):
        return {(None, config.num_attention_heads, config.num_key_value_heads)}
    layers = config.per_layer_config
    return {(config.layer_types[i], layers[i].num_attention_heads, layers[i].num_key_value_heads)
            for i in range(config.num_hidden_layers)}


def attention_context_parallel_problems(model: nn.Module, cp: int, cp_type: str, tp_size: int = 1,
                                        handled_layer_types=()) -> List[str]:
    """Every reason `enable_context_parallel` cannot run on `model` at `cp`: head counts Ulysses cannot split,
    layer types context parallel does not know (`handled_layer_types`: made CP by another hook), attention
    dropout, no attention layer at all."""
    cp_type = normalize_cp_type(cp_type)
    config = model.config
    problems: List[str] = []
    for kind, heads, kv_heads in sorted(_head_counts(config), key=str):
        problems += [p for p in context_parallel_problems(cp, cp_type, heads, kv_heads, tp_size,
                                                          layer_type=kind) if p not in problems]
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    supported = _SUPPORTED_LAYER_TYPES | set(handled_layer_types)  # e.g. linear attention, made CP by the caller
    if cp_type == "ring" or config._attn_implementation in (_SINK_ATTENTION, *_SDPA_FAMILY):  # windows: docstring
        supported |= {"sliding_attention"}
    if not layer_types <= supported:
        problems.append(f"cp_size (--context-parallel-size): layer types {sorted(layer_types - supported)} of "
                        f"model_type {config.model_type} are not supported by context parallel — use cp_size 1")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention_dropout: {config.attention_dropout} is not supported with context parallel — "
                        "set it to 0")
    if not _attention_modules(model):
        problems.append(f"cp_size (--context-parallel-size): found no attention layers in {type(model).__name__} "
                        "— use cp_size 1")
    return problems


def enable_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, cp_type: str, tp_size: int = 1,
                            handled_layer_types=()) -> nn.Module:
    """Makes every attention layer of an HF model attend across the cp ranks of `cp_mesh` (1-D).

    Call after tensor parallel (pass its `tp_size`: Ulysses splits the tp-local heads) and before recompute and
    FSDP. Inputs must then be split with `batch.shard_batch_for_cp` (same cp_type) and the loss reduced as
    `batch.cp_token_mean` explains. The model's config object is switched to our attention: do not share it.
    """
    problems = attention_context_parallel_problems(model, cp_mesh.size(), cp_type, tp_size, handled_layer_types)
    if problems:  # a run's model check reported them already (parallel.model_checks); a direct caller gets them here
        raise UsageError(problems)
    cp_type, config, modules = normalize_cp_type(cp_type), model.config, _attention_modules(model)
    inner = config._attn_implementation
    if inner == ATTENTION_NAME:
        raise RuntimeError("enable_context_parallel called twice on the same model")
    spec = ContextParallelSpec(group=cp_mesh.get_group(), cp_type=cp_type, inner_attention=inner)
    for module in modules:
        setattr(module, SPEC_ATTRIBUTE, spec)
    model.set_attn_implementation(ATTENTION_NAME)
    return model
