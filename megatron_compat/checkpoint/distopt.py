"""Reads the Adam state of a Megatron-LM distributed optimizer saved in its default ``dp_reshardable`` format
(``--ckpt-format torch_dist`` without ``--dist-ckpt-optim-fully-reshardable``) back into one full tensor per
parameter, in the model tensors' own (stacked ``decoder.layers.*``) keys.

Layout facts (megatron-core 0.16.1, ``optimizer/distrib_optimizer.py`` ``sharded_param_state_dp_reshardable`` and
``distributed/param_and_grad_buffer.py`` ``_ParamAndGradBuffer``):

- ``DistributedDataParallel`` puts every trainable parameter of a model chunk, in ``named_parameters()`` order,
  into one flat buffer per (param dtype, grad dtype) (expert-parallel parameters into separate buffers of a
  second optimizer). The buffer is filled in REVERSE parameter order (roughly backprop order); with the
  distributed optimizer each parameter starts at a multiple of 64 elements, and the buffer is cut into buckets:
  a bucket closes after the parameter that brings it to ``bucket_size`` elements (``--ddp-bucket-size``, default
  max(4e7, 1e6 x DP); no limit, i.e. one bucket, without ``--overlap-grad-reduce``; the first stage only under
  pipelining; the shared embedding alone), and its end is padded to a multiple of lcm(DP, 128) (lcm(DP, 128,
  2**16) with ``--ddp-pad-buckets-for-high-nccl-busbw``). Each DP rank owns the r-th 1/DP of every bucket.
- The checkpoint holds, per bucket, one global 1-D tensor of the bucket's UNPADDED length for each of ``param``
  (the fp32 main weights), ``exp_avg`` and ``exp_avg_sq``, under
  ``optimizer.distributed.dp_group_idx_{G}.gbuf_idx_{B}.dtype_({param dtype}, {grad dtype}).bucket_idx_{b}.{kind}``
  (G: the tensor/pipeline-parallel domain, B: model chunk x dtype); element i is the bucket's buffer element i
  (the alignment gaps hold garbage). Beside them, ShardedObjects ``...per_bucket_numel`` /
  ``...per_bucket_numel_unpadded`` (every bucket's padded / unpadded size) and ``...optimizer`` (the param groups
  with the Adam ``step``; ``...grad_scaler`` under fp16): not in common.pt.

How the layout is reproduced here: the parameter order is megatron-core's GPTModel module order (embedding,
each layer, final norm, MTP layers, output layer), the per-layer order being the local spec's (input norm before
the attention) or Transformer Engine's (the input norm inside ``linear_qkv``, after ``linear_proj``) — the
checkpoint's keys name both alike; multi-latent attention, MoE layers (router, each expert's fc1 and fc2, shared
experts: one buffer with the rest at expert-parallel size 1, as megatron-core 0.16.1 saves it) and MTP layers have
their places too. The bucket boundaries are not recomputed from flags (the bucket size, overlap and padding
options, the DP size, pipeline stage): they are read from the saved unpadded bucket sizes (a bucket ends exactly
where its last parameter ends, parameter starts being 64-aligned). The order candidate whose ``param`` slices
equal the saved model weights bit for bit (the model weights are the main weights cast to the model's dtype) is
the one used; if none does, the reader declines with one line. Declined too, one line each: several
tensor/pipeline-parallel domains (TP or PP > 1: each domain's buckets hold its own shards), expert-parallel or
several chained optimizers, several model chunks (virtual pipeline).

Why hand-written: megatron-core reads this format only into a live ``DistributedOptimizer`` built over the same
model and process groups; no library maps it to per-parameter tensors.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.checkpoint.dcp_format import read_flat_entries
from megatron_compat.checkpoint.safe_pickle import dcp_metadata

_BUCKET_RE = re.compile(r"^(.*?distributed\.dp_group_idx_\d+)\.gbuf_idx_(\d+)\.dtype_\((torch\.\w+), (torch\.\w+)\)"
                        r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_KINDS = ("param", "exp_avg", "exp_avg_sq")
_ALIGN = 64  # _ParamAndGradBuffer._pad_start_of_param_if_needed

# Within a layer: local spec = TransformerLayer's registration order (input_layernorm, self_attention:
# [linear_proj, linear_qkv, q_layernorm, k_layernorm], pre_mlp_layernorm, mlp: [linear_fc1, linear_fc2]); the
# Transformer Engine spec has the input norm inside linear_qkv, registered after linear_proj (SelfAttention
# builds linear_qkv after Attention built linear_proj); a norm's / linear's bias follows its weight.
# Multi-latent attention (MLASelfAttention, after linear_proj): the q projection(s), kv down and up, then the latent
# norms (fused into the up projections under Transformer Engine, their norm first). MoE (MoELayer): router, the
# experts (per expert fc1 then fc2: `_EXPERTS`), the shared experts (fc1, fc2, gate).
_MLA = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
        "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
        "self_attention.linear_kv_up_proj.weight")
_EXPERTS = "mlp.experts.experts."  # torch_dist's global [E, ...] tensors: expert e's fc1 and fc2 follow expert e-1's
_LOCAL = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.layer_norm_weight",
          "self_attention.linear_qkv.layer_norm_bias", "self_attention.linear_proj.weight",
          "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          *_MLA, "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
          "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias", "self_attention.kv_layernorm.weight",
          "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
          "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
          "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias", "mlp.router.weight", _EXPERTS,
          "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
          "mlp.shared_experts.gate_weight")
_TE = _LOCAL[:2] + _LOCAL[4:6] + _LOCAL[2:4] + _LOCAL[6:]
_BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
_MTP = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # MultiTokenPredictionLayer, then its layer, its norm
_HEAD = ("output_layer.weight", "output_layer.bias")
_BUFFERS = ("router.expert_bias",)  # in the model's tensors, not parameters: no place in the buffers


def _decline(it_dir: Path, why: str) -> UsageError:
    return UsageError(f"{it_dir}: the distributed optimizer's dp_reshardable state {why} — re-save the checkpoint "
                      f"with Megatron-LM's --dist-ckpt-optim-fully-reshardable, or resume with --no-load-optim")


def _layer_entries(weights: dict[str, torch.Tensor], prefix: str, index, layer_order: tuple) -> list:
    """[(model key, index into it)] of one layer under ``prefix``: its own keys (``decoder.layers.3.``, index None) or
    its slice ``index`` of the stacked ones (``decoder.layers.``); experts expand to one entry per expert."""
    out = []
    for name in layer_order:
        if name != _EXPERTS:
            if prefix + name in weights:
                out.append((prefix + name, index))
            continue
        fc1, fc2 = prefix + _EXPERTS + "linear_fc1.weight", prefix + _EXPERTS + "linear_fc2.weight"
        if fc1 in weights:
            stacked = weights[fc1] if index is None else weights[fc1][index]
            for e in range(stacked.shape[0]):
                at = e if index is None else (index, e)
                out += [(fc1, at), (fc2, at)]
    return out


def _param_order(weights: dict[str, torch.Tensor], layer_order: tuple, it_dir: Path) -> list[tuple[str, Any]]:
    """[(model key, index into it or None)] in megatron-core's named_parameters() order: embedding, the decoder
    layers (stacked under one key, or one key per layer), the final norm, the MTP layers, the output layer."""
    order = [(k, None) for k in _BEFORE if k in weights]
    per_layer = sorted({int(k.split(".")[2]) for k in weights if re.match(r"^decoder\.layers\.\d+\.", k)})
    stacked = {k for k in weights if k.startswith("decoder.layers.") and not re.match(r"^decoder\.layers\.\d+\.", k)}
    if per_layer and stacked:
        raise _decline(it_dir, "mixes stacked and per-layer decoder keys")
    if stacked:
        for i in range(weights[next(iter(stacked))].shape[0]):
            order += _layer_entries(weights, "decoder.layers.", i, layer_order)
    for i in per_layer:
        order += _layer_entries(weights, f"decoder.layers.{i}.", None, layer_order)
    order += [(k, None) for k in _AFTER if k in weights]
    for k in sorted({int(key.split(".")[2]) for key in weights if key.startswith("mtp.layers.")}):
        p = f"mtp.layers.{k}."
        order += [(p + name, None) for name in _MTP if p + name in weights]
        order += _layer_entries(weights, p + "transformer_layer.", None, layer_order)
        order += [(p + "final_layernorm.weight", None)] if p + "final_layernorm.weight" in weights else []
    order += [(k, None) for k in _HEAD if k in weights]
    placed = {key for key, _ in order}
    unknown = sorted(k for k in weights if k not in placed and not k.endswith(_BUFFERS))
    if unknown:
        raise _decline(it_dir, f"is laid out in parameter order, and {unknown[0]} has no known place in it")
    return order


def _place(order, weights, unpadded: list[int]) -> list[tuple[str, Any, int, int, int]] | None:
    """[(key, layer, bucket, start, end)] walking the buffer in reverse parameter order, or None if the saved
    unpadded bucket sizes cannot be met (a bucket must end exactly at a parameter's end)."""
    placed, bucket, pos = [], 0, 0
    for key, layer in reversed(order):
        if bucket >= len(unpadded):
            return None
        numel = (weights[key][layer] if layer is not None else weights[key]).numel()  # layer: an index
        start = math.ceil(pos / _ALIGN) * _ALIGN  # bucket starts are multiples of 128: same alignment
        end = start + numel
        if end > unpadded[bucket]:
            return None
        placed.append((key, layer, bucket, start, end))
        bucket, pos = (bucket + 1, 0) if end == unpadded[bucket] else (bucket, end)
    return placed if bucket == len(unpadded) else None


def _matches(placed, weights, buckets) -> bool:
    """The main weights' slices equal the saved model weights (cast to the model's dtype) bit for bit."""
    for key, layer, bucket, start, end in placed:
        saved = weights[key][layer] if layer is not None else weights[key]
        if not torch.equal(buckets[bucket]["param"][start:end].to(saved.dtype), saved.reshape(-1)):
            return False
    return True


def read_dp_reshardable(it_dir: Path, weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """({param / exp_avg / exp_avg_sq: {model key: full tensor shaped like weights[key]}}, the optimizer's
    non-tensor state {"optimizer": param groups with the step, "grad_scaler": ...}) of a dp_reshardable
    checkpoint whose model tensors are ``weights``."""
    keys = list(dcp_metadata(it_dir).state_dict_metadata)
    found = [m.groups() for m in map(_BUCKET_RE.match, keys) if m]
    domains = sorted({g[0] for g in found})
    if not domains:
        raise _decline(it_dir, "has no per-bucket buffers (optimizer.distributed.*.bucket_idx_*) in its files")
    if len(domains) > 1:
        raise _decline(it_dir, f"spans {len(domains)} tensor/pipeline-parallel domains or chained optimizers "
                               f"({', '.join(domains[:3])}): each holds its own shards in its own bucket order")
    gbufs = sorted({(int(g[1]), g[2], g[3]) for g in found})
    if len(gbufs) > 1:
        raise _decline(it_dir, f"has {len(gbufs)} grad buffers (model chunks or parameter dtypes "
                               f"{sorted({g[1] for g in gbufs})}); only one is mapped")
    prefix = domains[0]
    objects = read_flat_entries(it_dir, lambda k: k.startswith(prefix + ".") and not _BUCKET_RE.match(k))
    extra = {}
    for key, value in objects.items():  # unpickled through the allow-list (safe_pickle)
        if isinstance(value, list) and len(value) == 1:  # a ShardedObject reads back as the list of its one shard
            value = value[0]
        extra[key[len(prefix) + 1:].split("/")[0]] = value
    gbuf, param_dtype, _ = gbufs[0]
    per_bucket = extra.get("per_bucket_numel_unpadded")
    try:  # [{(param dtype, grad dtype): [numel per bucket]}] per grad buffer
        unpadded = [int(n) for n in next(iter(per_bucket[gbuf].values()))]
    except (TypeError, IndexError, KeyError, StopIteration, AttributeError):
        raise _decline(it_dir, "has no readable per_bucket_numel_unpadded record") from None
    tensors = read_flat_entries(it_dir, lambda k: bool(_BUCKET_RE.match(k)) and k.startswith(prefix + "."))
    buckets: list[dict] = [{} for _ in unpadded]
    for key, value in tensors.items():
        *_, bucket, kind = _BUCKET_RE.match(key).groups()
        if int(bucket) >= len(buckets) or value.numel() != unpadded[int(bucket)]:
            raise _decline(it_dir, f"bucket {bucket} holds {value.numel()} elements, its record says otherwise")
        buckets[int(bucket)][kind] = value
    if any(set(b) != set(_KINDS) for b in buckets):
        raise _decline(it_dir, "lacks a bucket's param / exp_avg / exp_avg_sq (not Adam?)")
    weights = {k: v for k, v in weights.items() if not k.endswith(_BUFFERS)}  # buffers have no optimizer state
    trained = {k: v for k, v in weights.items() if str(v.dtype) == param_dtype}
    if len(trained) != len(weights):
        raise _decline(it_dir, f"holds one {param_dtype} grad buffer, the model tensors have dtypes "
                               f"{sorted({str(v.dtype) for v in weights.values()})}")
    placed = None
    for layer_order in (_LOCAL, _TE):  # the spec whose order reproduces the saved main weights
        candidate = _place(_param_order(weights, layer_order, it_dir), weights, unpadded)
        if candidate is not None and _matches(candidate, weights, buckets):
            placed = candidate
            break
    if placed is None:
        raise _decline(it_dir, f"({len(unpadded)} buckets of {unpadded} elements) could not be matched to this "
                               f"model's parameters in megatron-core's GPTModel order (local or Transformer Engine "
                               f"spec)")
    out: dict[str, dict] = {kind: {} for kind in _KINDS}
    for kind in _KINDS:
        for key, index, bucket, start, end in placed:
            values = buckets[bucket][kind][start:end]
            if index is None:
                out[kind][key] = values.reshape(weights[key].shape).clone()
                continue
            full = out[kind].setdefault(key, torch.empty(weights[key].shape, dtype=values.dtype))
            full[index] = values.reshape(full[index].shape)  # one layer's (or expert's) slice of a stacked tensor
    return out, {k: v for k, v in extra.items() if k in ("optimizer", "grad_scaler")}
