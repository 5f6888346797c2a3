"""Attention with sinks (gpt_oss): softmax over the keys plus one learned logit per head that takes probability
mass and contributes no value — exactly, through PyTorch's scaled_dot_product_attention on every device.

transformers runs gpt_oss's sinks only in its eager attention (SDPA is refused, flex refuses sinks on CPU),
which materialises the whole (B, H, S, S) score tensor. Here the sink is an extra key column: a zero key and a
zero value whose additive mask entry is the sink logit, so its score is exactly `sink[h]` and SDPA's softmax
includes it in the denominator: the same maths as eager, in SDPA's fused (flash / memory-efficient / math)
kernels, query block by query block (`block`) so that the float mask never exceeds (B, H, block, S + 1).
Causal and sliding-window masking are built here when no mask is given; a given mask (bool: True = attend,
or additive float, as transformers passes it) is used as it is.

`sink_attention_reference` is the eager formula (a softmax over the concatenated logits), the oracle of the
tests. No triton or NPU kernel exists yet: torch_npu's fused attention has no sink input, so every device runs
the SDPA path (which is device-agnostic).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: Optional[int]) -> torch.Tensor:
    """(Sq, Sk) bool: causal, and within the last `sliding_window` keys when given (transformers' convention:
    a query sees keys with q - k < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if sliding_window:
        ok &= diff < sliding_window
    return ok


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor, *,
                   scale: Optional[float] = None, attention_mask: Optional[torch.Tensor] = None,
                   sliding_window: Optional[int] = None, block: int = 1024, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax([q·kᵀ·scale + mask, sink]) · [v; 0] for `query` (B, H, Sq, D), `key`/`value` (B, H, Sk, D)
    (heads already repeated for GQA), `sinks` (H,). Without `attention_mask`: causal (queries are the last Sq
    positions of the Sk keys) within `sliding_window`. `dropout_p`: attention dropout on the probabilities (SDPA's;
    the sink column's value is zero, so dropping it changes nothing). Returns (B, H, Sq, D)."""
    b, h, sq, d = query.shape
    sk = key.shape[2]
    scale = d ** -0.5 if scale is None else scale
    dtype = query.dtype
    zero = key.new_zeros(b, h, 1, d)
    key_ext, value_ext = torch.cat([key, zero], dim=2), torch.cat([value, value.new_zeros(b, h, 1, d)], dim=2)
    sink_col = sinks.to(dtype).view(1, h, 1, 1)
    k_pos = torch.arange(sk, device=query.device)
    outs = []
    for start in range(0, sq, block):
        stop = min(start + block, sq)
        if attention_mask is None:
            q_pos = torch.arange(sk - sq + start, sk - sq + stop, device=query.device)
            allowed = _allowed(q_pos, k_pos, sliding_window)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=query.device).masked_fill_(~allowed, float("-inf"))
            bias = bias.view(1, 1, stop - start, sk)
        else:
            part = attention_mask[..., start:stop, :sk]
            bias = part if part.dtype != torch.bool else torch.zeros(part.shape, dtype=dtype, device=query.device) \
                .masked_fill_(~part, float("-inf"))
        bias = torch.cat([bias.to(dtype).expand(b, h, stop - start, sk), sink_col.expand(b, h, stop - start, 1)],
                         dim=-1)
        outs.append(F.scaled_dot_product_attention(query[:, :, start:stop], key_ext, value_ext, attn_mask=bias,
                                                   scale=scale, dropout_p=dropout_p))
    return torch.cat(outs, dim=2)


def sink_attention_reference(query, key, value, sinks, *, scale=None, attention_mask=None, sliding_window=None):
    """The eager formula: logits, mask, the sink logit as one more column, softmax, drop it, times v."""
    b, h, sq, d = query.shape
    sk = key.shape[2]
    scale = d ** -0.5 if scale is None else scale
    logits = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is None:
        allowed = _allowed(torch.arange(sk - sq, sk), torch.arange(sk), sliding_window)
        logits = logits.masked_fill(~allowed, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attention_mask, float("-inf"))
    else:
        logits = logits + attention_mask
    combined = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(b, h, sq, 1).to(logits.dtype)], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)


def repeat_kv(hidden: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, KVH, S, D) → (B, KVH·groups, S, D), each key/value head repeated for its query heads."""
    if groups == 1:
        return hidden
    b, kvh, s, d = hidden.shape
    return hidden[:, :, None].expand(b, kvh, groups, s, d).reshape(b, kvh * groups, s, d)


def transformers_sink_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                                scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                                s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' attention-function signature (`AttentionInterface`), for gpt_oss's attention: its sinks
    (`s_aux`) and its layer's sliding window; `dropout` (transformers passes 0 in eval mode) as SDPA's."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    sinks = s_aux if s_aux is not None else query.new_full((query.shape[1],), float("-inf"))
    out = sink_attention(query, key, value, sinks, scale=scaling, attention_mask=attention_mask,
                         sliding_window=sliding_window, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def register_sink_attention(name: str = "sink_attention") -> str:
    """Registers `transformers_sink_attention` (and transformers' SDPA-style boolean masks) under `name` in
    transformers' attention interfaces; returns the name to set as `_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, transformers_sink_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
