"""Gated (SwiGLU-style) experts held as stacked weights, computed with a grouped GEMM.

`GroupedExperts` keeps all experts in two parameters, the layout of transformers 5's in-memory MoE experts:
`gate_up_proj` (E, 2I, H) — gate rows then up rows — and `down_proj` (E, H, I). Stacking lets expert
parallelism shard dim 0 (whole experts per rank) and FSDP shard dim 1, and lets one grouped GEMM run all
experts at once.

The module stays plain model code: it routes locally (no communication). Expert parallelism installs a
`dispatcher` from outside (`fsdp2_backend.parallel.moe_dispatch`), which moves the token slots to the rank
owning their expert and calls back `compute` there. Under expert parallelism the weights are DTensors
sharded on dim 0; `compute` uses the local experts (`to_local`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fsdp2_backend.distributed.dtensor import local_tensor
from fsdp2_backend.models.moe.routing import sort_by_expert
from fsdp2_backend.kernels.grouped_gemm import grouped_linear



class GroupedExperts(nn.Module):
    """E gated experts `down(act(gate(x)) * up(x))` over stacked weights; forward takes the router's top-k.

    `dispatcher(experts, hidden, top_k_index, top_k_weights)`, when set, replaces the local routing.
    `use_grouped_gemm` selects `torch grouped_mm` / `npu_grouped_matmul` over the per-expert loop.
    `gemm(x, weight, counts)`, when set from outside (the `quantize` stage: MXFP8 grouped GEMM), replaces both.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_fn: Callable,
                 use_grouped_gemm: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = act_fn
        self.use_grouped_gemm = use_grouped_gemm
        self.dispatcher: Optional[Callable] = None
        self.gemm: Optional[Callable] = None

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for slot rows `x` grouped by this rank's experts (`counts` rows each), unweighted."""
        # weights in the rows' dtype: experts FSDP leaves alone (parallel.ignored_modules, MindSpeed's LongCat YAML)
        # keep their fp32 parameters under a bf16 compute dtype
        gemm = self.gemm or (lambda rows, weight, n: grouped_linear(rows, weight.to(rows.dtype), n,
                                                                    self.use_grouped_gemm))
        gate_up = gemm(x, local_tensor(self.gate_up_proj), counts)
        gate, up = gate_up.chunk(2, dim=-1)
        return gemm(self.activation(gate, up), local_tensor(self.down_proj), counts)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation between the two GEMMs (a model with a clamped SwiGLU overrides it)."""
        return self.act_fn(gate) * up

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """`hidden` (T, H); `top_k_index`, `top_k_weights` (T, k) → the weighted sum of each token's experts."""
        if self.dispatcher is not None:
            return self.dispatcher(self, hidden, top_k_index, top_k_weights)
        top_k = top_k_index.shape[-1]
        order, counts = sort_by_expert(top_k_index.reshape(-1), self.num_experts)
        token = order // top_k
        out = self.compute(hidden[token], counts)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        # Slots of a token arrive in ascending expert order, so the sum runs in the same order as HF's loop.
        return torch.zeros_like(hidden).index_add_(0, token, out.to(hidden.dtype))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.gate_up_proj.shape[2]}, "
                f"intermediate={self.down_proj.shape[2]}, grouped_gemm={self.use_grouped_gemm}")
