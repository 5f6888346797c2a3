"""The optimisation flags that select a faster implementation of the same math, applied to a built model.

`apply_fused_ops(model, optimization_args, device_type, log)` runs once per model, before parallelisation, and
logs one line per flag that is set, saying which implementation runs (or that the flag has no effect):

- `use_fused_rmsnorm`: every HF RMSNorm module (class name ending in "RMSNorm", with `weight` and
  `variance_epsilon`, whose forward computes `kernels.rmsnorm.rms_norm_reference`'s math — checked on a probe
  input, so variants such as 1 + weight norms are left alone) gets an instance-level `forward` calling
  `kernels.rmsnorm.rms_norm`, which dispatches by tensor device (NPU kernel / triton kernel / reference).
- `use_fused_rotary_pos_emb`: HF attention modules call the module-level `apply_rotary_pos_emb` of their modeling
  file. Rather than patching that file's global (which would change every model in the process), each
  attention module of THIS model gets an instance-level copy of its class's `forward` whose globals map
  `apply_rotary_pos_emb` to `kernels.rotary.apply_rotary_pos_emb`; decorators made with functools.wraps are
  rebuilt around the copy. Reversible per module (`del module.forward`); the class and the file are untouched.
- `use_flash_attn`: CUDA → transformers' "flash_attention_2" when flash_attn is installed, else "sdpa" (whose
  CUDA backend picks the flash kernel itself for fp16/bf16); NPU → the npu_fusion_attention path is not built
  yet, "sdpa" runs; CPU → the model's attention stays as it is (SDPA is the reference there). Context parallel,
  applied later, switches the model to its own attention and keeps this choice as its inner attention.
- GDN flags (`use_triton_gdn`, `use_flash_gdn`, `use_triton_rmsnormgated`, a non-default `gdn_chunk_size`):
  no model here has Gated DeltaNet layers; the line says the flag has no effect (or, for a native transformers
  model that has them, that transformers' own implementation runs).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import types
from typing import Callable, Optional

import torch
from torch import nn

from fsdp2_backend.config import OptimizationArguments
from kernels.dispatch import describe_choice
from kernels.rmsnorm import rms_norm, rms_norm_implementation, rms_norm_reference
from kernels.rotary import apply_rotary_pos_emb, rotary_implementation

ROTARY_GLOBAL = "apply_rotary_pos_emb"
GDN_FLAGS = ("use_triton_gdn", "use_flash_gdn", "use_triton_rmsnormgated")


def _default_log(line: str) -> None:
    from fsdp2_backend.training.checkpoint_io import print_rank0

    print_rank0(line)


# --- RMSNorm ---------------------------------------------------------------------------------------------------

def _is_rmsnorm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _computes_reference_rmsnorm(cls: type) -> bool:
    """True when `cls.forward` matches the reference math on a probe (the class, not the instance, is probed:
    the model may live on the meta device)."""
    torch_rng = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=torch_rng)
    stand_in = types.SimpleNamespace(weight=torch.randn(8, generator=torch_rng), variance_epsilon=1e-6)
    try:
        got = cls.forward(stand_in, x)
    except Exception:  # a forward that needs more than weight/variance_epsilon is not the plain RMSNorm
        return False
    return isinstance(got, torch.Tensor) and torch.equal(got, rms_norm_reference(x, stand_in.weight, 1e-6))


def _fused_rmsnorm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _use_fused_rmsnorm(model: nn.Module, device_type: str) -> str:
    norms = [m for m in model.modules() if _is_rmsnorm(m)]
    plain = {cls: _computes_reference_rmsnorm(cls) for cls in {type(m) for m in norms}}
    fused = [m for m in norms if plain[type(m)]]
    for module in fused:
        module.forward = types.MethodType(_fused_rmsnorm_forward, module)
    detail = f"{len(fused)} RMSNorm modules"
    skipped = sorted(cls.__name__ for cls, ok in plain.items() if not ok)
    if skipped:
        detail += f"; {', '.join(skipped)} compute other math and keep their own forward"
    if not fused:
        return f"use_fused_rmsnorm: no plain RMSNorm modules in {type(model).__name__} — no effect"
    return describe_choice("use_fused_rmsnorm", device_type, rms_norm_implementation(device_type), detail)


# --- RoPE --------------------------------------------------------------------------------------------------------

def _with_global(fn: Callable, name: str, value: object) -> Callable:
    """A copy of `fn` that sees `value` for the global `name`; wrappers from functools.wraps are rebuilt around it."""
    inner = getattr(fn, "__wrapped__", None)
    closure = fn.__closure__
    if inner is not None and closure:
        new_inner = _with_global(inner, name, value)
        closure = tuple(types.CellType(new_inner) if _holds(cell, inner) else cell for cell in closure)
        new_globals = fn.__globals__
    else:
        new_globals = {**fn.__globals__, name: value}
    copy = types.FunctionType(fn.__code__, new_globals, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(copy, fn)  # name, doc, signature attributes — but `__wrapped__` must name the copy
    if inner is not None and fn.__closure__:
        copy.__wrapped__ = new_inner
    else:
        del copy.__wrapped__
    return copy


def _holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _calls_global(fn: Callable, name: str) -> bool:
    while fn is not None:
        if name in fn.__code__.co_names:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _use_fused_rotary(model: nn.Module, device_type: str) -> str:
    patched = {}  # attention class → its forward seeing our RoPE (one copy per class)
    for module in model.modules():
        cls = type(module)
        forward = getattr(cls, "forward", None)
        if cls not in patched and forward is not None and _calls_global(forward, ROTARY_GLOBAL):
            patched[cls] = _with_global(forward, ROTARY_GLOBAL, apply_rotary_pos_emb)
        if cls in patched:
            module.forward = types.MethodType(patched[cls], module)
    if not patched:
        return f"use_fused_rotary_pos_emb: {type(model).__name__} calls no {ROTARY_GLOBAL} — no effect"
    names = ", ".join(sorted(c.__name__ for c in patched))
    return describe_choice("use_fused_rotary_pos_emb", device_type, rotary_implementation(device_type),
                           f"in {names}; no triton RoPE kernel" if device_type == "cuda" else f"in {names}")


# --- attention ---------------------------------------------------------------------------------------------------

def _use_flash_attn(model: nn.Module, device_type: str) -> str:
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation"):
        return f"use_flash_attn: {type(model).__name__} has no attention interface — no effect"
    if device_type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            model.set_attn_implementation("flash_attention_2")
            return "use_flash_attn: flash_attention_2 (flash_attn package) on cuda"
        model.set_attn_implementation("sdpa")
        return ("use_flash_attn: flash_attn is not installed — running sdpa on cuda (its flash backend serves "
                "fp16/bf16 without an explicit mask)")
    if device_type == "npu":
        model.set_attn_implementation("sdpa")
        return "use_flash_attn: the npu_fusion_attention path is not built yet — running sdpa on npu"
    return f"use_flash_attn: no flash attention kernel on {device_type} — running the model's {current!r} attention"


# --- Gated DeltaNet ----------------------------------------------------------------------------------------------

def _gdn_lines(model: nn.Module, optimization_args) -> list:
    set_flags = [flag for flag in GDN_FLAGS if getattr(optimization_args, flag)]
    default_chunk = next(f.default for f in dataclasses.fields(OptimizationArguments) if f.name == "gdn_chunk_size")
    if optimization_args.gdn_chunk_size != default_chunk:  # only a changed value was asked for
        set_flags.append(f"gdn_chunk_size={optimization_args.gdn_chunk_size}")
    if not set_flags:
        return []
    gdn_layers = sum(1 for m in model.modules() if "GatedDeltaNet" in type(m).__name__)
    if gdn_layers:
        why = (f"{type(model).__name__} has {gdn_layers} Gated DeltaNet layers, which run transformers' own "
               "implementation; this project's GDN kernels are not built yet — no effect")
    else:
        why = f"{type(model).__name__} has no Gated DeltaNet layers — no effect"
    return [f"{flag}: {why}" for flag in set_flags]


def apply_fused_ops(model: nn.Module, optimization_args, device_type: str,
                    log: Optional[Callable[[str], None]] = None) -> nn.Module:
    """Applies the fast-implementation flags of `optimization_args` to `model` (in place; returned for chaining).

    Call once, before parallelisation. `device_type` is the run's device ("cpu" / "cuda" / "npu"); `log`
    receives one line per flag that is set (rank 0's stdout by default).
    """
    log = log or _default_log
    if optimization_args.use_fused_rmsnorm:
        log(_use_fused_rmsnorm(model, device_type))
    if optimization_args.use_fused_rotary_pos_emb:
        log(_use_fused_rotary(model, device_type))
    if optimization_args.use_flash_attn:
        log(_use_flash_attn(model, device_type))
    for line in _gdn_lines(model, optimization_args):
        log(line)
    return model
