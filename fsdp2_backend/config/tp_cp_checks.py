"""Torch-free checks of a tensor/context-parallel layout against a model's head counts and sequence length.

Config validation calls these before any process group or model exists (and without importing torch), so a
bad layout is reported as `error: ...` lines, all at once. The runtime modules (`tensor_parallel`,
`context_parallel`) call the same functions again with what they see on the built model.
"""
from __future__ import annotations

from typing import List, Optional

from fsdp2_backend.usage_errors import UsageError

CP_TYPES = ("ulysses", "ring")


def normalize_cp_type(name: str) -> str:
    """The engine's cp_type ("ulysses" or "ring"); Megatron's --context-parallel-algo names end at the front end."""
    if name in CP_TYPES:
        return name
    if name == "kvallgather":  # MindSpeed's: each rank's queries over every key/value — ring's exact attention
        return "ring"
    raise UsageError(f"parallel.cp_type: unknown value {name!r} — use one of {', '.join(CP_TYPES)}")


def tensor_parallel_problems(num_heads: int, num_kv_heads: int, tp_size: int) -> List[str]:
    """Why attention heads cannot be split over `tp_size` ranks (empty list when they can)."""
    problems = []
    if tp_size < 1:
        problems.append(f"tp_size (--tensor-model-parallel-size): must be >= 1, got {tp_size} — use 1 or more")
        return problems
    if num_heads % tp_size:
        problems.append(f"tp_size (--tensor-model-parallel-size): num_attention_heads={num_heads} is not divisible "
                        f"by tp_size={tp_size} — pick a tp size that divides {num_heads}")
    if num_kv_heads % tp_size:
        problems.append(f"tp_size (--tensor-model-parallel-size): num_key_value_heads={num_kv_heads} is not "
                        f"divisible by tp_size={tp_size} — pick a tp size that divides {num_kv_heads}")
    return problems


def context_parallel_problems(cp_size: int, cp_type: str, num_heads: int, num_kv_heads: int, tp_size: int = 1,
                              seq_length: Optional[int] = None, layer_type: Optional[str] = None) -> List[str]:
    """Why a context-parallel layout cannot run (empty list when it can). Head counts are the model's totals;
    `layer_type` names the layers they belong to when layer types have their own head counts (step35)."""
    if cp_size <= 1:
        return []
    cp_type = normalize_cp_type(cp_type)
    problems = []
    if cp_type == "ulysses" and num_heads % tp_size == 0 and num_kv_heads % tp_size == 0:
        heads, kv_heads = num_heads // tp_size, num_kv_heads // tp_size
        where = f" per tensor-parallel rank (tp_size={tp_size})" if tp_size > 1 else ""
        where = f" of the {layer_type} layers{where}" if layer_type else where
        if heads % cp_size:
            problems.append(f"cp_size (--context-parallel-size): Ulysses needs the attention heads{where} "
                            f"({heads}) divisible by cp_size={cp_size} — pick a cp size that divides {heads} "
                            f"or use cp_type ring")
        if kv_heads % cp_size and cp_size % kv_heads:
            problems.append(f"cp_size (--context-parallel-size): Ulysses needs the key/value heads{where} "
                            f"({kv_heads}) to divide cp_size={cp_size} or be divisible by it — change cp_size "
                            f"or use cp_type ring")
    if seq_length is not None:
        problems += sequence_length_problems(seq_length, cp_size, cp_type)
    return problems


def sequence_length_problems(seq_length: int, cp_size: int, cp_type: str) -> List[str]:
    """Why a sequence cannot be cut for cp: ring needs 2*cp equal chunks, Ulysses cp."""
    cp_type = normalize_cp_type(cp_type)
    chunks = 2 * cp_size if cp_type == "ring" else cp_size
    if cp_size <= 1 or seq_length % chunks == 0:
        return []
    return [f"seq_length (--seq-length): {seq_length} is not divisible by {chunks} "
            f"({'2 x ' if cp_type == 'ring' else ''}cp_size={cp_size} for {cp_type}) — use a multiple of {chunks}"]


def check_layout(num_heads: int, num_kv_heads: int, tp_size: int = 1, cp_size: int = 1, cp_type: str = "ulysses",
                 seq_length: Optional[int] = None) -> None:
    """Raises one UsageError listing every tensor/context-parallel problem of this layout."""
    problems = tensor_parallel_problems(num_heads, num_kv_heads, tp_size)
    problems += context_parallel_problems(cp_size, cp_type, num_heads, num_kv_heads, tp_size, seq_length)
    if problems:
        raise UsageError(problems)
