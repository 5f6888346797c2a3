"""FP8 block-quantised checkpoint tensors (DeepSeek-V3 / MiniMax-M2 style) → full-precision tensors.

Such checkpoints store a quantised linear weight `W` (rows, cols) as `<key>` in float8 (e4m3) plus
`<key>_scale_inv` (ceil(rows / br), ceil(cols / bc)) in fp32, `weight_block_size` [br, bc] (128 × 128) in
config.json's `quantization_config` (`quant_method: fp8`): the real weight is `W[i, j] · scale_inv[i // br,
j // bc]`. The streaming loader dequantises each such key as it reads it (no full FP8 model in memory).

Written here rather than taken from transformers: its `Fp8Dequantize` is a conversion op bound to its own
loading pipeline and requires shapes that divide into the scale grid; the definition is three lines
(tests compare with transformers' dequantisation on the same tensors).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

SCALE_SUFFIX = "_scale_inv"


def block_size(hf_config) -> Optional[Tuple[int, int]]:
    """The (rows, cols) block of an FP8 block-quantised checkpoint's config, or None for other checkpoints."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    get = quant.get if isinstance(quant, dict) else (lambda k, d=None: getattr(quant, k, d))
    if str(get("quant_method", "")).lower() != "fp8":
        return None
    size = get("weight_block_size", None) or (128, 128)
    return int(size[0]), int(size[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int] = (128, 128),
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight` (..., rows, cols) float8 times its per-block `scale_inv` (..., ceil(rows/br), ceil(cols/bc))."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (weight.float() * scale[..., :rows, :cols]).to(dtype)
