"""FP8 linears (`kernels.float8`) under tensor and context parallel: each rank's GEMMs on its shards, every scale
the one the whole tensor gives in one process.

A column-parallel linear holds W's rows (the output features N), a row-parallel one W's columns (the input
features K, with the input's last dim); the six GEMM operands of `kernels.float8` are then split along N or K:

    operand   dims    column-parallel (N split)     row-parallel (K split)
    x         M × K   whole                         K split
    w         N × K   N split                       K split
    dy        M × N   N split                       whole
    w_t       K × N   N split                       K split
    dy_t      N × M   N split                       whole
    x_t       K × M   whole                         K split

(M tokens; a row-parallel input is whole on every rank after the all-gather that sequence parallel adds at the
block's entry. Context parallel splits M: every operand with an M dim, under any layout; a 128-block along M is then
one whole global block on one rank, which validation requires of the sequence length.) For a split dim, a block that
spans the whole dim (tensorwise, and rowwise along the reduction dim) gets the maximum of the ranks' amaxes (an all-
reduce of one value per block); blocks of one element along it (rowwise across) are local; 128-blocks (blockwise)
are local when each shard holds whole blocks, and otherwise the operand is all-gathered along that dim, quantised
whole and this rank's part taken. The scales therefore equal one process's, and so do the results (the sums that
tensor parallel splits: below).

Gradients: a column-parallel layer's input gradient is a partial sum over the ranks' N slices (reduced as DTensor
does, `to_local(grad_placements=Partial)`), a row-parallel layer's output a partial sum over K. Both partial sums
are added over the ranks in fp64, the GEMM's accumulator (`kernels.float8._gemm`), and rounded after: one process
rounds the whole sum once, and a rank's rounded part would differ from it in the last bit, which the next tensorwise
quantisation can turn into another FP8 value. (A row-parallel output is therefore all-reduced, not reduce-scattered
under sequence parallel: the layer's output layout then takes this rank's part.) Ascend NPUs have no fp64 GEMM
(`_gemm` accumulates in fp32 there): the sums are then the device's. A linear whose weight is replicated on the tp
mesh (MLA's latent projections) runs whole on every rank; a sequence-split input is gathered first and its output
split again.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdp2_backend.kernels.float8 import fake_quantize, float8_linear

_DIMS = dict(x="MK", w="NK", dy="MN", w_t="KN", dy_t="NM", x_t="KM")
_WIDE = torch.float64  # kernels.float8's accumulator: partial sums stay in it until the ranks' parts are added


class ShardQuantizer:
    """A `kernels.float8.Quantizer` for operands split along the dims `splits` names ({"N" | "K" | "M": process
    group}): tensor parallel splits N or K, context parallel M (the tokens)."""

    def __init__(self, splits: Dict[str, object]):
        self.splits = splits

    def __call__(self, name: str, t: torch.Tensor, block: Tuple[int, int], dtype: torch.dtype,
                 pow2: bool) -> torch.Tensor:
        reduce_over, gather = [], None
        for symbol, group in self.splits.items():
            dim = _DIMS[name].find(symbol)
            if dim < 0 or block[dim] == 1:  # whole here, or one block per element along the split dim
                continue
            if block[dim] == 0:  # one block along the whole split dim: the amax over every rank's part
                reduce_over.append(group)
            elif t.shape[dim] % block[dim]:  # blocks across shards (tensor parallel only: validation for M)
                gather = (dim, group)
            # else: equal shards of whole blocks, each block on one rank
        amax_reduce = None
        if reduce_over:
            def amax_reduce(amax: torch.Tensor) -> torch.Tensor:
                for group in reduce_over:
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
                return amax
        if gather is None:
            return fake_quantize(t, block, dtype, pow2, amax_reduce=amax_reduce)
        dim, group = gather
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        whole = fake_quantize(torch.cat(parts, dim=dim), block, dtype, pow2, amax_reduce=amax_reduce)
        return whole.narrow(dim, dist.get_rank(group) * t.shape[dim], t.shape[dim])


def _as_dtensor(x: torch.Tensor, mesh) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)


def float8_linear_tp(x: torch.Tensor, weight: DTensor, bias: Optional[torch.Tensor], recipe: str,
                     grad_format: str, token_group=None, quantize=None) -> DTensor:
    """`float8_linear` for a weight that is a DTensor on a 1-D tp mesh (Shard(0), Shard(1) or Replicate);
    `token_group`: the context-parallel group splitting the tokens, if any. `quantize`: a quantiser whose scales
    are already the whole tensor's (the delayed recipe's, `float8_delayed`), used on the shards as it is."""
    tokens = {"M": token_group} if token_group is not None else {}

    def shard_quantizer(splits):
        return quantize if quantize is not None else ShardQuantizer(splits)

    mesh = weight.device_mesh
    (placement,) = weight.placements
    x = _as_dtensor(x, mesh)
    last = x.ndim - 1
    dtype = x.dtype
    if isinstance(placement, Shard) and placement.dim == 0:  # column-parallel: N split
        # the input gradient's parts are summed over the ranks in fp64 (the GEMM's accumulator), then rounded
        # (the cast first: DTensor keeps a Partial gradient partial through a cast, the redistribute sums it)
        x = x.to(_WIDE).redistribute(mesh, [Replicate()])
        local = float8_linear(x.to_local(grad_placements=[Partial()]), weight.to_local(), None, recipe,
                              grad_format, shard_quantizer({"N": mesh.get_group(), **tokens}), out_dtype=dtype)
        out = DTensor.from_local(local, mesh, [Shard(last)], run_check=False)
    elif isinstance(placement, Shard):  # row-parallel: K split, partial outputs summed in fp64, then rounded
        x = x.redistribute(mesh, [Shard(last)])
        local = float8_linear(x.to_local(), weight.to_local(), None, recipe, grad_format,
                              shard_quantizer({"K": mesh.get_group(), **tokens}), out_dtype=_WIDE)
        out = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        out = out.redistribute(mesh, [Replicate()]).to(dtype)  # the layer's output layout then takes its part
    else:  # replicated weight: the whole GEMM on every rank
        placements = x.placements
        x = x.redistribute(mesh, [Replicate()])
        local = float8_linear(x.to_local(), weight.to_local(), None, recipe, grad_format, shard_quantizer(tokens))
        out = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        if placements != out.placements:
            out = out.redistribute(mesh, placements)
    if bias is not None:
        out = out + _as_dtensor(bias, mesh).to(out.dtype)
    return out
