"""FP8 (float8) training recipes for a linear layer: the three GEMMs with FP8 operands, emulated.

Recipes (Megatron `--fp8-recipe`, torchao `Float8LinearConfig` recipes, DeepSeek-V3 / Transformer Engine's
`Float8BlockScaling`); each operand gets one scale per block of the shape below, scale = fp8_max / amax(block)
(amax clamped at 1e-12), elements = saturate(x · scale) cast to E4M3 (±448) or E5M2 (±57344):

    recipe       forward x @ W.T           grad input dy @ W          grad weight dy.T @ x          scales
    tensorwise   x: tensor, W: tensor      dy: tensor, W: tensor      dy: tensor, x: tensor         fp32
    rowwise      x: 1×K, W: 1×K (rows)     dy: 1×N, W: N×1 (cols)     dy, x: M×1 (per column)       powers of 2
    blockwise    x: 1×128, W: 128×128      dy: 1×128, W: 128×128      dy, x: 128×1 (along tokens)   powers of 2
    delayed      as tensorwise, the scale from the tensor's amax history (`scaled_quantize`)  fp32

(M tokens, K inputs, N outputs: every block runs along the GEMM's reduction dim.) `delayed` is Transformer Engine's
DelayedScaling (Megatron's default recipe): its scales come from earlier steps, so its quantiser carries them
(`parallel/float8_delayed.py`); an operand and its transpose share one scale. Gradients (`dy`) are E5M2 with
`grad_format="hybrid"` (Megatron `--fp8-format hybrid`), E4M3 otherwise. A block dim that does not divide its
tensor is zero-padded (zeros change no amax); blockwise weights must be whole 128×128 blocks
(`blockwise_supported`).

Emulated on every device: each operand is quantised and dequantised (to fp32), then one plain GEMM accumulated in
fp64 (`_gemm`) — what an FP8 GEMM computes up to accumulation order. Scales depend only on the operand's own values,
so a weight quantised after FSDP's all-gather (in its parameter dtype) gets the one-process values: torchao's FP8
all-gather, which casts the shards with the scale of the all-reduced amax, gives the same elements; here the gather
stays high precision.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")
BLOCK = 128
_EPS = 1e-12


def fake_quantize(x: torch.Tensor, block: Tuple[int, int], dtype: torch.dtype = E4M3, pow2: bool = False,
                  amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """x (2-D) quantised to `dtype` with one scale per `block` (rows, cols; 0 = the whole dim) and back, in fp32.

    `amax_reduce` (in place, on the per-block amax): for a tensor whose whole-dim blocks are split across ranks,
    the maximum over those ranks (tensor parallel), so that every shard gets the one-process scale."""
    rows, cols = x.shape
    br, bc = block[0] or rows, block[1] or cols
    pad_r, pad_c = -rows % br, -cols % bc
    t = F.pad(x.float(), (0, pad_c, 0, pad_r)) if pad_r or pad_c else x.float()
    tiles = t.reshape(t.shape[0] // br, br, t.shape[1] // bc, bc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    if amax_reduce is not None:
        amax_reduce(amax)
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=_EPS)
    if pow2:  # rounded down to a power of two (exact to apply and to invert)
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (tiles * scale).clamp(-fmax, fmax).to(dtype)
    out = (q.float() / scale).reshape(t.shape)
    return out[:rows, :cols]


def scaled_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """x quantised to `dtype` with a given scale (a 0-d fp32 tensor) and back, in fp32: saturate(x · scale) / scale."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


# (x, W) forward, (dy, W) grad input, (dy.T, x.T) grad weight: each operand's block, rows × cols of the operand as it
# enters its GEMM (A @ B.T, both with the reduction dim last).
_BLOCKS = {
    "tensorwise": dict(x=(0, 0), w=(0, 0), dy=(0, 0), w_t=(0, 0), dy_t=(0, 0), x_t=(0, 0)),
    "rowwise": dict(x=(1, 0), w=(1, 0), dy=(1, 0), w_t=(1, 0), dy_t=(1, 0), x_t=(1, 0)),
    "blockwise": dict(x=(1, BLOCK), w=(BLOCK, BLOCK), dy=(1, BLOCK), w_t=(BLOCK, BLOCK), dy_t=(1, BLOCK),
                      x_t=(1, BLOCK)),
}
_BLOCKS["delayed"] = _BLOCKS["tensorwise"]
_POW2 = ("rowwise", "blockwise")  # scales rounded down to powers of two


def blockwise_supported(weight_shape) -> bool:
    """Blockwise weights are whole 128×128 blocks (Transformer Engine's and DeepSeek-V3's requirement)."""
    return all(d % BLOCK == 0 for d in weight_shape)


# A quantiser of the six operands: (operand name as in _BLOCKS, 2-D tensor, block, dtype, pow2) → fake-quantised.
Quantizer = Callable[[str, torch.Tensor, Tuple[int, int], torch.dtype, bool], torch.Tensor]


def local_quantizer(name: str, t: torch.Tensor, block: Tuple[int, int], dtype: torch.dtype,
                    pow2: bool) -> torch.Tensor:
    """Every operand whole in this process (no tensor parallel)."""
    return fake_quantize(t, block, dtype, pow2)


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T of two dequantised operands. Accumulated in fp64 where the device has it: each product of two
    dequantised FP8 values is exact there, so the sum hardly depends on its order (as an FP8 GEMM's exact
    products and wide accumulator), and tensor parallel's split GEMMs give one process's numbers — in fp32,
    tensorwise scales (not powers of two) make the products inexact and the GEMM's blocking (which follows the
    shapes) moves the rounding, which the next quantisation can turn into a different FP8 value. Ascend NPUs
    have no fp64 GEMM: fp32 there."""
    if a.device.type == "npu":
        return a @ b.t()
    return a.double() @ b.double().t()


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str, grad_format: str,
                quantize: Quantizer, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
        ctx.recipe, ctx.grad_format, ctx.weight_dtype, ctx.quantize = recipe, grad_format, weight.dtype, quantize
        ctx.save_for_backward(x, weight)
        b, pow2 = _BLOCKS[recipe], recipe in _POW2
        x2 = x.reshape(-1, x.shape[-1])
        out = _gemm(quantize("x", x2, b["x"], E4M3, pow2), quantize("w", weight.detach(), b["w"], E4M3, pow2))
        return out.to(out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        b, pow2, quantize = _BLOCKS[ctx.recipe], ctx.recipe in _POW2, ctx.quantize
        gdt = E5M2 if ctx.grad_format == "hybrid" else E4M3
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_t = weight.detach().t()  # (K, N): the reduction dim N last
            grad_x = _gemm(quantize("dy", g2, b["dy"], gdt, pow2), quantize("w_t", w_t, b["w_t"], E4M3, pow2))
            grad_x = grad_x.to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(quantize("dy_t", g2.t(), b["dy_t"], gdt, pow2),
                           quantize("x_t", x2.t(), b["x_t"], E4M3, pow2))
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  recipe: str = "tensorwise", grad_format: str = "e4m3",
                  quantize: Quantizer = local_quantizer, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with its three GEMMs in FP8 under `recipe` (module docstring).

    `quantize`: how each operand gets its scales; tensor parallel passes one that takes the scales of the whole
    tensor over the ranks that hold its shards (`parallel/float8_tp.py`). `out_dtype` (default x's): tensor
    parallel keeps a partial GEMM output in the accumulator's fp64 until the ranks' parts are summed."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}: one of {', '.join(RECIPES)}")
    if recipe == "delayed" and quantize is local_quantizer:
        raise ValueError("the delayed recipe takes its scales from an amax history: pass its quantizer "
                         "(parallel/float8_delayed.py)")
    out = _Float8Linear.apply(x, weight, recipe, grad_format, quantize, out_dtype)
    return out if bias is None else out + bias.to(out.dtype)
