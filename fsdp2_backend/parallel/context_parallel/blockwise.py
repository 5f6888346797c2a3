"""One block of attention that also returns its log-sum-exp, and the matching backward.

Ring attention computes attention of local queries against one key/value block at a time and merges the
partial results with their log-sum-exp (online softmax); its backward needs, per block, the gradients given the
*merged* output and log-sum-exp. torch's public SDPA returns neither, so: on CPU we call the flash kernel that
SDPA itself dispatches to (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward, which take the
merged `out`/`lse`), elsewhere an exact fp32 math version. Layout: [batch, heads, seq, head_dim]; key/value may
have fewer heads (GQA) — they are expanded here and their gradients summed back. A boolean `mask` (True = attend;
sliding windows, whose blocks the causal flag cannot describe) always takes the math version; a row it masks
entirely gets lse -inf and a zero output (no NaN into the merge).
"""
from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_kv_grad(grad: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(dim=2)


def _use_cpu_flash(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _math_scores(q: Tensor, k: Tensor, causal: bool, scale: float, mask=None) -> Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        # top-left aligned, like SDPA's is_causal: query i sees keys 0..i
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask=None) -> Tuple[Tensor, Tensor]:
    """Attention of `q` over one key/value block: (out in q's dtype, lse in fp32 [b, h, sq])."""
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    if mask is not None:
        scores = _math_scores(q, k, causal, scale, mask)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))  # masked rows: 0
        return torch.matmul(probs, v.float()).to(q.dtype), lse
    if _use_cpu_flash(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
        return out, lse.float()
    scores = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   scale: float, mask=None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged `out` and `lse` of these query rows: (dq, dk, dv)."""
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    if _use_cpu_flash(q) and mask is None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), ke.contiguous(), ve.contiguous(), out.contiguous(),
            lse.to(torch.float32).contiguous(), 0.0, causal, scale=scale)
    else:
        probs = torch.exp(_math_scores(q, ke, causal, scale, mask) - lse.unsqueeze(-1))
        dout32 = dout.float()
        dv = torch.matmul(probs.transpose(-1, -2), dout32)
        dprobs = torch.matmul(dout32, ve.float().transpose(-1, -2))
        delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)
        dscores = probs * (dprobs - delta)
        dq = torch.matmul(dscores, ke.float()) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), q.float()) * scale
    return dq, _fold_kv_grad(dk, groups), _fold_kv_grad(dv, groups)


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online-softmax merge of a block's result into the running fp32 (out, lse), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(
        block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)
