"""The MXFP8 training weight: a tensor subclass holding the high-precision weight, whose linears run in MXFP8.

`MXTrainingWeight` wraps a parameter's data (fp32 master weights stay fp32; the optimizer and its state see
plain tensors: every op other than `F.linear` unwraps). Its `F.linear` runs `kernels.mx_linear.mx_linear` with
the weight itself as the `WeightQuantizer`:

- the row-wise (forward) and column-wise (backward) quantisations of a weight are computed once and cached
  until the weight is written in place (the optimizer step; any mutating op on the weight bumps its
  generation), so gradient-accumulation micro-batches and reshard-after-forward re-gathers reuse them;
- FSDP2 all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`, the pattern of torchao's
  float8 training weights): with low-precision all-gather each rank quantises its own shard (rows of W) and
  FSDP gathers the E4M3 elements and E8M0 scales — 1 + 1/32 bytes per element instead of bf16's 2.
  `on-demand` gathers the quantisation the pass needs (row-wise in forward, column-wise in backward), `all`
  gathers both at once. Column-wise blocks run along W's dim 0, so a shard must hold whole blocks: weights
  whose shard rows are not a multiple of 32 (or unevenly sharded) gather in high precision and quantise after
  the gather (torchao's MXFP8 wrapper does that for every weight) — the same values either way.

Why our own subclass: torchao's `MXFP8TrainingWeightWrapperTensor` all-gathers in bf16 and re-quantises the
weight in every GEMM call; low-precision MX all-gather and the per-step cache are what it lacks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from fsdp2_backend.kernels.mx import ELEM_DTYPE, SCALE_DTYPE, mx_dequantize, mx_quantize
from fsdp2_backend.kernels.mx_linear import MX, mx_linear

aten = torch.ops.aten

# Ops whose result is still this weight (FSDP2 builds its shards and unsharded views with them).
_PRESERVE = {aten.new_zeros.default, aten.empty_like.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
             aten.as_strided.default, aten._to_copy.default, aten.split.Tensor, aten.clone.default,
             aten.alias.default}
# Ops that make an alias of the whole weight: the alias shares the quantisation cache and gathered data.
_ALIAS = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default}


@dataclass
class MXSettings:
    """One weight's MX settings, shared by every tensor derived from it."""
    low_precision_gather: bool = True
    mode: str = "on-demand"  # or "all"
    gather_both: bool = False  # set after FSDP when the unit keeps its gathered weights for backward
    quantizations: int = 0  # weight quantisations computed (row-wise and column-wise count one each)
    generation: int = 0  # bumped by every in-place write to the weight (the optimizer step): the cache key


@dataclass
class _Shared:
    """State shared by a weight and its aliases: the cache, and the quantisations an all-gather delivered."""
    cache: Dict[str, Tuple[int, MX]] = field(default_factory=dict)
    gathered: Dict[str, MX] = field(default_factory=dict)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class MXTrainingWeight(torch.Tensor):
    _data: Optional[torch.Tensor]  # None for a low-precision gathered weight until something needs its values

    @staticmethod
    def __new__(cls, data: Optional[torch.Tensor], settings: MXSettings, shared: Optional[_Shared] = None,
                meta: Optional[torch.Tensor] = None):
        if data is not None:
            return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                       device=data.device, requires_grad=data.requires_grad)
        shape, dtype, device = meta  # a low-precision gathered weight: contiguous, no high-precision data yet
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def __init__(self, data, settings, shared=None, meta=None):
        self._data = data
        self.settings = settings
        self._shared = shared if shared is not None else _Shared()

    def __repr__(self):
        return f"MXTrainingWeight(shape={tuple(self.shape)}, dtype={self.dtype}, {self.settings})"

    def __tensor_flatten__(self):
        return ["_data"], (self.settings, self._shared)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return MXTrainingWeight(inner["_data"], *meta)

    # -- values ---------------------------------------------------------------------------------------------
    def hp_data(self) -> torch.Tensor:
        """The high-precision values (a low-precision gathered weight dequantises its row-wise quantisation)."""
        if self._data is None:
            q, scale = self._shared.gathered["row"]
            self._data = mx_dequantize(q, scale, self.dtype).reshape(self.shape)
        return self._data

    def _quantize(self, kind: str, dtype: torch.dtype) -> MX:
        if self._shared.gathered:  # a low-precision gathered weight: only what the all-gather delivered exists
            if kind not in self._shared.gathered:
                raise RuntimeError(f"MXFP8 weight {tuple(self.shape)}: the {kind}-wise quantisation was not gathered "
                                   f"for this pass (on-demand all-gather)")
            return self._shared.gathered[kind]
        data = self.hp_data()
        key = f"{kind}:{dtype}"
        hit = self._shared.cache.get(key)
        if hit is not None and hit[0] == self.settings.generation:
            return hit[1]
        source = data.detach().to(dtype)
        value = mx_quantize(source if kind == "row" else source.t().contiguous())
        self.settings.quantizations += 1
        self._shared.cache[key] = (self.settings.generation, value)
        return value

    def rowwise(self) -> MX:
        return self._quantize("row", self.dtype)

    def colwise(self) -> MX:
        return self._quantize("col", self.dtype)

    # -- torch function / dispatch ---------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "linear":
            x, weight = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            if isinstance(weight, cls) and not isinstance(x, cls):
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return mx_linear(x, weight, bias, quantizer=weight)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        if func._schema.is_mutable:
            # An in-place write (the optimizer step, a checkpoint load): the inner tensor's version counter does
            # not move below the wrapper, so the cached quantisations are invalidated here.
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, cls):
                    t.settings.generation += 1
        if func in _ALIAS and args[0] is source and tuple(_out_shape(func, args)) == tuple(source.shape):
            data = None if source._data is None else func(source._data, *args[1:], **kwargs)
            return cls(data, source.settings, source._shared, meta=(source.shape, source.dtype, source.device))
        out = func(*pytree.tree_map_only(cls, lambda t: t.hp_data(), args),
                   **pytree.tree_map_only(cls, lambda t: t.hp_data(), kwargs))
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, source.settings), out)

    # -- FSDP2 all-gather extension ----------------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype
        settings = self.settings
        if not settings.low_precision_gather:
            return (self._data.to(dtype),), ("hp", dtype)
        if settings.mode == "all" or settings.gather_both:
            kinds = ("row", "col")
        else:
            kinds = ("col",) if _in_backward() else ("row",)
        inputs = []
        for kind in kinds:
            q, scale = self._quantize(kind, dtype)
            if kind == "col":  # W.T's blocks run along W's rows: back to W's row layout, scales as (rows, K/32)
                q, scale = q.t().contiguous(), scale.t().contiguous().reshape(q.shape[1], -1)
            inputs += [q.view(torch.uint8), scale.view(torch.uint8)]
        return tuple(inputs), (kinds, dtype)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        kinds, dtype = metadata
        if kinds == "hp":
            (data,) = outputs
            if out is not None:
                target = out._local_tensor if isinstance(out, DTensor) else out
                if target._data is None or target._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                    target._data = data
                # The cache stays: the gathered values change only when the shards do, which bumps the generation.
                return
            return MXTrainingWeight(data, self.settings), (data,)
        gathered = {}
        for i, kind in enumerate(kinds):
            q, scale = outputs[2 * i].view(ELEM_DTYPE), outputs[2 * i + 1].view(SCALE_DTYPE)
            if kind == "col":
                rows, cols = q.shape
                q, scale = q.t().contiguous(), scale.reshape(rows // 32, cols).t().contiguous()
            gathered[kind] = (q, scale)
        if out is not None:
            target = out._local_tensor if isinstance(out, DTensor) else out
            target._shared.gathered = gathered
            target._shared.cache.clear()
            target._data = None
            return
        shared = _Shared(gathered=gathered)
        meta = (outputs[0].shape, dtype, outputs[0].device)
        return MXTrainingWeight(None, self.settings, shared, meta=meta), ()


def _out_shape(func, args) -> torch.Size:
    if func is aten.as_strided.default or func is aten.view.default:
        return torch.Size(args[1])
    return args[0].shape


def unwrap(value: Any) -> Any:
    """A state-dict value with its MX wrapper removed (plain tensor, or a DTensor over the plain shard)."""
    if isinstance(value, MXTrainingWeight):
        return value.hp_data()
    if isinstance(value, DTensor) and isinstance(value._local_tensor, MXTrainingWeight):
        return DTensor.from_local(value._local_tensor.hp_data(), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return value
