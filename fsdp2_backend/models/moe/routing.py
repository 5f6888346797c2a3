"""Routing helpers: grouping token slots by expert, and the fixed balanced assignment of `fix_router`.

A "slot" is one (token, k) pair of a top-k routing, numbered `token * top_k + k` (row-major over the router's
(tokens, top_k) index tensor). Experts compute on slots grouped expert after expert.
"""
from __future__ import annotations

from typing import Tuple

import torch


def sort_by_expert(expert_of_slot: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): `order` lists slots expert after expert (stable: ascending slot within an expert),
    `counts[e]` is how many slots expert e got."""
    order = torch.argsort(expert_of_slot, stable=True)
    counts = torch.bincount(expert_of_slot, minlength=num_experts)
    return order, counts


def balanced_assignment(num_tokens: int, top_k: int, num_experts: int, device=None) -> torch.Tensor:
    """A fixed (tokens, top_k) expert index: slot s goes to expert s mod E, round robin.

    Every expert gets `num_tokens * top_k / E` slots (±1), and a token's k experts are distinct when
    top_k <= E. Used by `fix_router` to take routing imbalance out of performance measurements; it ignores
    the router's choice, so results differ from normal training.
    """
    slots = torch.arange(num_tokens * top_k, device=device)
    return (slots % num_experts).view(num_tokens, top_k)
