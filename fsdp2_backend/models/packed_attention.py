"""Attention over packed rows (`neat_packing`) without an S×S mask, hooked in through transformers'
AttentionInterface as `PACKED_ATTENTION`.

Documents are read from the `position_ids` the model passes to its attention (restarting at 0 at each document,
`kernels/varlen.py`), turned into `cu_seqlens` once per call. Per device:
- cuda: flash-attention's `flash_attn_varlen_func` on the flattened tokens (when flash_attn is installed);
- npu: `torch_npu.npu_fusion_attention` in TND layout with `actual_seq_qlen` / `actual_seq_kvlen` (cumulative);
- otherwise (cpu, or the packages missing): exact causal SDPA run per document — memory is the longest
  document's, never the packed row's S×S.
Rows without a restart take plain causal SDPA. transformers builds no mask for a registered function it has no
mask rule for, and must not: the boundaries are the position ids'.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from fsdp2_backend.kernels.varlen import cu_seqlens_from_position_ids, is_packed
from fsdp2_backend.usage_errors import UsageError

PACKED_ATTENTION = "fsdp2_packed"


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sdpa_per_document(q, k, v, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """q/k/v [b, h, s, d] (kv heads already expanded) → [b, s, h, d], causal within each document."""
    b, h, s, d = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(b * s, h, d)  # noqa: E731
    qf, kf, vf = flat(q), flat(k), flat(v)
    out = torch.empty_like(qf)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        seg = lambda t: t[start:end].transpose(0, 1).unsqueeze(0)  # noqa: E731  [1, h, n, d]
        out[start:end] = F.scaled_dot_product_attention(seg(qf), seg(kf), seg(vf), is_causal=True,
                                                        scale=scale)[0].transpose(0, 1)
    return out.reshape(b, s, h, d)


def _flash_varlen(q, k, v, cu, max_len: int, scale: float) -> torch.Tensor:  # pragma: no cover - cuda only
    from flash_attn import flash_attn_varlen_func

    b, h, s, d = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)  # noqa: E731
    out = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu, cu, max_len, max_len, softmax_scale=scale,
                                 causal=True)
    return out.reshape(b, s, h, d)


def _npu_tnd(q, k, v, cu, scale: float) -> torch.Tensor:  # pragma: no cover - npu only
    import torch_npu

    b, h, s, d = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)  # noqa: E731
    # TND with a causal lower-triangular compressed mask (sparse_mode 3); lengths are cumulative ends
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1)
    ends = cu[1:].tolist()
    out = torch_npu.npu_fusion_attention(flat(q), flat(k), flat(v), h, "TND", atten_mask=mask, scale=scale,
                                         sparse_mode=3, actual_seq_qlen=ends, actual_seq_kvlen=ends)[0]
    return out.reshape(b, s, h, d)


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                     sliding_window: Optional[int] = None, position_ids: Optional[torch.Tensor] = None, **kwargs):
    """The registered function: q [b, h, s, d], k/v [b, hkv, s, d] → ([b, s, h, d], None)."""
    if attention_mask is not None:
        raise RuntimeError("packed attention takes no attention mask: documents come from position_ids")
    if sliding_window is not None or dropout:
        raise RuntimeError("packed attention: sliding windows and attention dropout are not supported")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    device = query.device.type
    if not is_packed(position_ids):
        k, v = _expand_kv(key, groups), _expand_kv(value, groups)
        return F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale).transpose(1, 2), None
    cu, max_len = cu_seqlens_from_position_ids(position_ids.expand(query.shape[0], -1))
    cu = cu.to(query.device)
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return _flash_varlen(query, key, value, cu, max_len, scale), None
    if device == "npu":
        return _npu_tnd(query, key, value, cu, scale), None
    return _sdpa_per_document(query, _expand_kv(key, groups), _expand_kv(value, groups), cu, scale), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def enable_packed_attention(model) -> str:
    """Switches an HF model to the packed attention (full-attention layers only: sliding windows and sinks are
    not built, declined); returns a one-line description."""
    config = getattr(model, "config", None)
    if not hasattr(model, "set_attn_implementation") or config is None:
        raise UsageError(f"data.neat_packing: {type(model).__name__} has no attention interface to run packed "
                         "rows through — use packing without neat_packing")
    other = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if other or getattr(config, "model_type", None) == "gpt_oss":
        what = f"layer types {other}" if other else "attention sinks"
        raise UsageError(f"data.neat_packing: {what} of model_type {config.model_type} are not built in the packed "
                         "attention — use packing without neat_packing")
    model.set_attn_implementation(PACKED_ATTENTION)
    return "neat_packing: attention runs per packed document (varlen), no S×S mask"
