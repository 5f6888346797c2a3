"""Token dispatch for expert parallelism: move each token slot to the rank owning its expert and back.

Experts are split evenly over the `ep` ranks of an expert-parallel group, in order (rank r owns global experts
`r*E_local .. (r+1)*E_local-1`). A dispatcher is installed on a `GroupedExperts` module and called as
`dispatcher(experts, hidden, top_k_index, top_k_weights)`:

1. permute: order the (token, k) slots by global expert, hence by destination rank;
2. exchange the per-expert slot counts (`all_to_all_single` of E integers) so every rank knows its uneven
   receive sizes before any token moves;
3. `all_to_all_single` of the slot rows with uneven splits (autograd: the backward is the reverse exchange);
4. regroup received rows — ordered (source rank, local expert) — by local expert, run `experts.compute`
   (the grouped GEMM), and restore the received order;
5. the reverse `all_to_all_single`;
6. unpermute: weight each slot by its routing weight and sum a token's slots.

`eager` does each step as its own tensor: the token rows are expanded k-fold then gathered, and the combine
un-sorts the slots into a (T, k, H) tensor, weights it and sums over k. `fused` gathers slot rows straight
from the tokens (one copy instead of two), skips the regrouping when a rank holds one expert, and combines
with a single weighted `index_add_` (no un-sort, no (T, k, H) tensor). Both give the same result (up to the
summation order of a token's k > 2 expert outputs). `mc2` (Ascend's fused dispatch/combine kernels) exists
only on NPU.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.models.moe.routing import sort_by_expert

DISPATCHERS = ("eager", "fused", "mc2")


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Slot counts per global expert (E,) → (ep, E_local): how many slots each source rank sends to each of
    this rank's experts. Not differentiable (sizes only)."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def _all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(permutation).scatter_(0, permutation, torch.arange(len(permutation),
                                                                                device=permutation.device))


class AllToAllDispatcher:
    """The `eager` dispatcher over the expert-parallel process group `group`."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep_size = dist.get_world_size(group)

    def __call__(self, experts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        order, counts = sort_by_expert(top_k_index.reshape(-1), experts.num_experts)
        send = self._send_rows(hidden, order, top_k)
        recv_counts = exchange_counts(counts, self.group)
        in_splits = counts.view(self.ep_size, -1).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        received = _all_to_all(send, out_splits, in_splits, self.group)
        computed = self._compute(experts, received, recv_counts)
        returned = _all_to_all(computed, in_splits, out_splits, self.group)
        return self._combine(returned, hidden, order, top_k_weights)

    def _send_rows(self, hidden, order, top_k):
        return hidden.repeat_interleave(top_k, dim=0)[order]

    def _compute(self, experts, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for rows ordered (source rank, local expert), returned in that order."""
        regroup, local_counts = _regroup_by_local_expert(recv_counts)
        out = experts.compute(received[regroup], local_counts)
        return out[_inverse(regroup)]

    def _combine(self, returned, hidden, order, top_k_weights):
        slots = returned[_inverse(order)].view(*top_k_weights.shape, -1)
        return (slots * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1).to(hidden.dtype)


class FusedAllToAllDispatcher(AllToAllDispatcher):
    """The `fused` dispatcher: same exchange, fewer passes over the token rows (see the module docstring)."""

    def _send_rows(self, hidden, order, top_k):
        return hidden.index_select(0, order // top_k)

    def _compute(self, experts, received, recv_counts):
        if recv_counts.shape[1] == 1:  # one local expert: the received rows are already grouped
            return experts.compute(received, recv_counts.sum(0))
        return super()._compute(experts, received, recv_counts)

    def _combine(self, returned, hidden, order, top_k_weights):
        top_k = top_k_weights.shape[-1]
        weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        return torch.zeros_like(hidden).index_add_(0, order // top_k, weighted.to(hidden.dtype))


def _regroup_by_local_expert(recv_counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) that sort rows laid out (source rank, local expert) by local expert."""
    ep, num_local = recv_counts.shape
    local_expert = torch.arange(num_local, device=recv_counts.device).repeat(ep)
    return sort_by_expert(torch.repeat_interleave(local_expert, recv_counts.flatten()), num_local)


def make_dispatcher(kind: str, group: dist.ProcessGroup, device_type: str):
    """The dispatcher named by `parallel.ep_dispatcher` for the expert-parallel `group`."""
    if kind == "eager":
        return AllToAllDispatcher(group)
    if kind == "fused":
        return FusedAllToAllDispatcher(group)
    if kind == "mc2":
        where = "on Ascend NPU only" if device_type != "npu" else "on NPU, but not in this version yet"
        raise UsageError(f"parallel.ep_dispatcher: 'mc2' (Ascend MC2 fused dispatch/combine) is available {where}"
                         f" — use 'eager' or 'fused'")
    raise UsageError(f"parallel.ep_dispatcher: '{kind}' is not a dispatcher — use one of {', '.join(DISPATCHERS)}")
