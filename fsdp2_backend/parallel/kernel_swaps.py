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
  Only a file whose `apply_rotary_pos_emb` computes the reference RoPE exactly (probed with full- and
  half-width cos/sin tables) is patched: partial rotary (Qwen3-Next) and gpt_oss's half-table RoPE (with
  YaRN) keep their own, named in the flag's one log line.
- `use_flash_attn`: CUDA → transformers' "flash_attention_2" when flash_attn is installed, else "sdpa" (whose
  CUDA backend picks the flash kernel itself for fp16/bf16); NPU → the npu_fusion_attention path is not built
  yet, "sdpa" runs; CPU → the model's attention stays as it is (SDPA is the reference there). Context parallel,
  applied later, switches the model to its own attention and keeps this choice as its inner attention.
- GDN flags (`use_triton_gdn`, `use_flash_gdn`, `use_triton_rmsnormgated`, a non-default `gdn_chunk_size`):
  the `qwen3_next` model id's GDN layers take them (its registry `configure` sets them; the line says what
  runs); a native transformers model with GDN layers runs transformers' own GDN and the line says the flag has
  no effect there, as it does for a model without GDN layers. `use_triton_rmsnormgated` also switches the
  gated RMSNorms that offer `kernels.rmsnorm_gated` behind a `use_kernel` attribute (the `mamba3` model id).
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
from fsdp2_backend.kernels.dispatch import describe_choice
from fsdp2_backend.kernels.gated_delta_rule import fla_importable
from fsdp2_backend.kernels.rmsnorm_gated import rms_norm_gated_implementation
from fsdp2_backend.kernels.rmsnorm import rms_norm, rms_norm_implementation, rms_norm_reference
from fsdp2_backend.kernels.rotary import apply_rotary_pos_emb, apply_rotary_pos_emb_reference, rotary_implementation

ROTARY_GLOBAL = "apply_rotary_pos_emb"
GDN_FLAGS = ("use_triton_gdn", "use_flash_gdn", "use_triton_rmsnormgated")


def _default_log(line: str) -> None:
    from fsdp2_backend.distributed.console import print_rank0

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


def _called_rotary(fn: Callable) -> Optional[Callable]:
    """The `apply_rotary_pos_emb` that `fn` (or the function it wraps) calls: its modeling file's global."""
    while fn is not None:
        if ROTARY_GLOBAL in fn.__code__.co_names:
            return fn.__globals__.get(ROTARY_GLOBAL)
        fn = getattr(fn, "__wrapped__", None)
    return None


def _rotary_is_reference(rope: Optional[Callable]) -> bool:
    """True when `rope` computes the reference RoPE exactly, probed with full-width cos/sin and with half-width
    ones (partial rotary, or gpt_oss-style half tables): a function that treats either differently (partial
    rotary passes the other half through; gpt_oss rotates halves with half tables) is not the reference."""
    if rope is None:
        return False
    if rope is apply_rotary_pos_emb_reference or rope is apply_rotary_pos_emb:
        return True
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    for width in (8, 4):
        cos, sin = torch.randn(2, 5, width, generator=gen), torch.randn(2, 5, width, generator=gen)
        try:
            want = apply_rotary_pos_emb_reference(q, k, cos, sin)
        except RuntimeError:
            want = None
        try:
            got = rope(q, k, cos, sin)
        except Exception:  # noqa: BLE001 — any failure on a probe the reference handles means other math
            got = None
        if (want is None) != (got is None):
            return False
        if want is not None and not (isinstance(got, tuple) and len(got) == 2
                                     and all(torch.equal(a, b) for a, b in zip(got, want))):
            return False
    return True


def _use_fused_rotary(model: nn.Module, device_type: str) -> str:
    patched = {}  # attention class → its forward seeing our RoPE (one copy per class)
    skipped = set()  # classes whose RoPE is other math (partial rotary, gpt_oss's half tables): left alone
    for module in model.modules():
        cls = type(module)
        forward = getattr(cls, "forward", None)
        if cls not in patched and cls not in skipped and forward is not None and _calls_global(forward,
                                                                                             ROTARY_GLOBAL):
            if _rotary_is_reference(_called_rotary(forward)):
                patched[cls] = _with_global(forward, ROTARY_GLOBAL, apply_rotary_pos_emb)
            else:
                skipped.add(cls)
        if cls in patched:
            module.forward = types.MethodType(patched[cls], module)
    left = (f"; {', '.join(sorted(c.__name__ for c in skipped))} apply another RoPE (partial rotary or other "
            "tables) and keep their own") if skipped else ""
    if not patched:
        if skipped:
            return (f"use_fused_rotary_pos_emb: {', '.join(sorted(c.__name__ for c in skipped))} of "
                    f"{type(model).__name__} apply another RoPE (partial rotary or other tables) than the fused "
                    "kernel computes — left alone, no effect")
        return f"use_fused_rotary_pos_emb: {type(model).__name__} calls no {ROTARY_GLOBAL} — no effect"
    names = ", ".join(sorted(c.__name__ for c in patched))
    return describe_choice("use_fused_rotary_pos_emb", device_type, rotary_implementation(device_type),
                           (f"in {names}; no triton RoPE kernel" if device_type == "cuda" else f"in {names}") + left)


# --- attention ---------------------------------------------------------------------------------------------------

def _use_flash_attn(model: nn.Module, device_type: str) -> str:
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation"):
        return f"use_flash_attn: {type(model).__name__} has no attention interface — no effect"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):  # gpt_oss: sdpa / flash drop sinks
        from fsdp2_backend.kernels.sink_attention import register_sink_attention

        model.set_attn_implementation(register_sink_attention())
        return f"use_flash_attn: attention sinks — SDPA with the sinks as a key column (sink_attention) on {device_type}"
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

def _gdn_lines(model: nn.Module, optimization_args, device_type: str) -> list:
    set_flags = [flag for flag in GDN_FLAGS if getattr(optimization_args, flag)]
    default_chunk = next(f.default for f in dataclasses.fields(OptimizationArguments) if f.name == "gdn_chunk_size")
    if optimization_args.gdn_chunk_size != default_chunk:  # only a changed value was asked for
        set_flags.append(f"gdn_chunk_size={optimization_args.gdn_chunk_size}")
    if not set_flags:
        return []
    gdn = [m for m in model.modules() if "GatedDeltaNet" in type(m).__name__]
    ours = [m for m in gdn if hasattr(m, "implementation")]  # models.qwen3_next.GatedDeltaNet (model_id set)
    if not gdn:
        return [f"{flag}: {type(model).__name__} has no Gated DeltaNet layers — no effect" for flag in set_flags]
    if not ours:
        why = (f"{type(model).__name__} has {len(gdn)} Gated DeltaNet layers, which run transformers' own "
               "implementation (model.model_id unset) — set model.model_id qwen3_next for this project's GDN "
               "kernels; no effect")
        return [f"{flag}: {why}" for flag in set_flags]
    lines = []
    for flag in set_flags:
        if flag == "use_triton_gdn":
            if device_type == "cuda" and fla_importable():
                lines.append(f"use_triton_gdn: flash-linear-attention's triton chunk_gated_delta_rule and this "
                             f"project's triton causal conv1d in {len(ours)} Gated DeltaNet layers on cuda")
            elif device_type == "cuda":
                lines.append(f"use_triton_gdn: this project's triton gated delta rule (kernels/gated_delta_rule_"
                             f"triton.py; flash-linear-attention not installed) and triton causal conv1d in "
                             f"{len(ours)} Gated DeltaNet layers on cuda")
            else:
                lines.append(f"use_triton_gdn: no triton Gated DeltaNet kernel on {device_type} (triton kernels "
                             "on CUDA only) — running the torch reference")
        elif flag == "use_flash_gdn":
            lines.append(f"use_flash_gdn: torch_npu's AscendC Gated DeltaNet op in {len(ours)} layers on "
                         f"{device_type}")
        elif flag == "use_triton_rmsnormgated":
            lines.append(describe_choice(flag, device_type, rms_norm_gated_implementation(device_type),
                                         f"the output norm of {len(ours)} Gated DeltaNet layers"))
        else:
            lines.append(f"{flag}: chunk size of the {len(ours)} Gated DeltaNet layers")
    return lines


def _gated_norm_kernel_modules(model: nn.Module) -> list:
    """Gated RMSNorms that offer the `kernels.rmsnorm_gated` op behind a `use_kernel` switch (Mamba-3's)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNormGated") and hasattr(m, "use_kernel")]


def _use_gated_norm_kernel(model: nn.Module, norms: list, device_type: str) -> str:
    for module in norms:
        module.use_kernel = True
    return describe_choice("use_triton_rmsnormgated", device_type, rms_norm_gated_implementation(device_type),
                           f"{len(norms)} gated RMSNorm modules of {type(model).__name__}")


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
    gated_norms = _gated_norm_kernel_modules(model) if optimization_args.use_triton_rmsnormgated else []
    if gated_norms:  # a model without GDN layers whose gated norms take the flag (mamba3)
        log(_use_gated_norm_kernel(model, gated_norms, device_type))
        optimization_args = dataclasses.replace(optimization_args, use_triton_rmsnormgated=False)
    for line in _gdn_lines(model, optimization_args, device_type):
        log(line)
    return model
