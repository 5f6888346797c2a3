"""Megatron's routing maths as plain functions: top-k (softmax, pre-softmax, sigmoid with a selection bias,
group-limited), Sinkhorn, the scores the load-balancing losses use, the Switch / z losses and the expert-bias
update — megatron-core's `moe_utils` re-stated (tests compare each with megatron-core 0.16.1 on the same
logits). The module that holds state and process-group hooks is `router.TopKRouter`.
MindSpeed-LLM's additions, which megatron-core 0.16.1 lacks (tests/models/test_router_mindspeed.py checks them against
its formulas): the `sqrtsoftplus` score function (DeepSeek-V4: sqrt(softplus(logits)), routed like sigmoid) and
the scores of its `--seq-aux` loss under balancing 'none' (`mindspeed_seq_aux_scores`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F


def group_limited_topk(scores: torch.Tensor, top_k: int, num_groups: int, group_topk: int,
                       group_score_topk: Optional[int] = None):
    """Top-k within the `group_topk` expert groups whose top-`group_score_topk` scores sum highest; None: the top
    (k / group_topk) (megatron-core's rule; transformers' DeepSeek-V3 / GLM-MoE-DSA sum the top 2)."""
    tokens, experts = scores.shape
    per_group = group_score_topk or top_k // group_topk
    group_scores = scores.view(tokens, num_groups, -1).topk(per_group, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=top_k, dim=-1)


def topk_routing(logits: torch.Tensor, s: Any, expert_bias: Optional[torch.Tensor] = None,
                 index: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights, index), both (tokens, k): the selected experts and their combine weights, by the router's settings
    `s` (`router.RouterSettings`: read by field, so this module needs nothing of the router's). `index`, when
    given, replaces the selection (fix_router) and the weights are computed for it the same way."""

    def pick(scores):
        if index is not None:
            return scores.gather(1, index), index
        if s.group_topk:
            return group_limited_topk(scores, s.top_k, s.num_groups, s.group_topk, s.group_score_topk)
        return torch.topk(scores, k=s.top_k, dim=1)

    if s.score_function == "softmax":
        if s.pre_softmax:
            probs, idx = pick(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            top, idx = pick(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    elif s.score_function in ("sigmoid", "sqrtsoftplus"):  # sqrtsoftplus: MindSpeed-LLM's / DeepSeek-V4's
        scores = _pointwise_scores(logits, s.score_function).type_as(logits)
        if expert_bias is not None:
            idx = index if index is not None else pick(scores + expert_bias)[1]
            probs = torch.gather(scores, 1, idx).type_as(logits)
        else:
            probs, idx = pick(scores)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20) if s.top_k > 1 else probs
    else:
        raise ValueError(f"unknown router score function {s.score_function!r}")
    if s.scaling_factor:
        probs = probs * s.scaling_factor
    return probs, idx


def _pointwise_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-expert scores in fp32: sigmoid, or sqrt(softplus(logits)) (`sqrtsoftplus`)."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    return F.softplus(logits.float()).sqrt()


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(cost) (megatron-core's, same iteration and tolerance)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, top_k: int, training: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights, index): experts chosen on the Sinkhorn-balanced logits in training (on the activations in
    evaluation); weights are sigmoid (k = 1) or softmax scores of the chosen experts, not renormalised."""
    act = torch.sigmoid(logits) if top_k == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    with torch.no_grad():
        chooser = sinkhorn(logits.float()) if training else act
        idx = torch.topk(chooser, k=top_k, dim=1)[1]
    return act.gather(1, idx), idx


def aux_loss_scores(logits: torch.Tensor, top_k: int, score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing_map (T, E) bool, scores (T, E)) the load-balancing losses use: plain top-k of softmax scores,
    or of sum-normalised sigmoid / sqrtsoftplus scores (no bias, no groups; sqrtsoftplus as Megatron-LM's
    `compute_routing_scores_for_aux_loss` after 0.16.1 defines it, in fp32)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits) if score_function == "sigmoid" else _pointwise_scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=top_k, dim=1)[1]
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True), scores


def mindspeed_seq_aux_scores(logits: torch.Tensor, score_function: str,
                             expert_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(T, E) fp32 scores of MindSpeed's sequence aux loss (`--seq-aux` under balancing 'none', its
    `apply_seq_aux_loss`): softmax over all experts; or sigmoid / sqrtsoftplus scores shifted by the expert bias
    (the selection bias, no gradient) and normalised over all experts."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    scores = _pointwise_scores(logits, score_function)
    if expert_bias is not None:
        scores = scores + expert_bias.detach().float()
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens,
                               top_k: int, num_experts: int, coeff: float) -> torch.Tensor:
    """E · coeff / (k · T²) · Σ_e (Σ_t p_te) · n_e — the Switch Transformer loss, Megatron's normalisation."""
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (top_k * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff · mean over tokens of logsumexp(logits)² (ST-MoE)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """bias + rate · sign(mean load − load), per router row (the token counts already summed over ranks)."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate
