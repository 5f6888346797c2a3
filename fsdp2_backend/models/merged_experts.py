"""MindSpeed-LLM's merged-expert checkpoint layout, read into this project's stacked experts.

MindSpeed's FSDP2 examples load HF weights converted offline (`tests/tools/fsdp2/moe_hf_param_merge_experts.sh`,
which runs `moe_hf_param_merge_experts.py`, at v26.1.0): per layer, every expert's `gate` / `up` / `down`
(`[I, H]`, `[I, H]`, `[H, I]`) become two tensors under the parameter's own name,
`...experts.gate_up_proj` = cat([gate], [up]) over the expert's rows, transposed: `[E, H, 2I]` ("3d"), or that
reshaped to `[E·H, 2I]` ("2d"), and `...experts.down_proj` = down transposed: `[E, I, H]` or `[E·I, H]`. Our
experts hold transformers' in-memory layout, `gate_up_proj` `[E, 2I, H]` and `down_proj` `[E, H, I]` (what
transformers' own save writes for LongCat under the same names): the merged tensors are these transposed. The shape
tells the two apart; where it cannot (H = 2I, or H = I for down_proj: not LongCat-Flash-Lite's 3072 / 1024), the
tensor is read as transformers' layout.
"""
from __future__ import annotations

from typing import Tuple

import torch

from fsdp2_backend.usage_errors import UsageError


def from_merged(name: str, tensor: torch.Tensor, experts: int, hidden: int, inter: int) -> torch.Tensor:
    """The in-memory stacked expert parameter `name` from a tensor stored under that name; other names as given."""
    if name.endswith("experts.gate_up_proj"):
        merged, ours = (experts, hidden, 2 * inter), (experts, 2 * inter, hidden)
    elif name.endswith("experts.down_proj"):
        merged, ours = (experts, inter, hidden), (experts, hidden, inter)
    else:
        return tensor
    shape = tuple(tensor.shape)
    if shape == ours:  # transformers' layout (also where the merged one has the same shape)
        return tensor
    if shape == (merged[0] * merged[1], merged[2]):  # the script's "2d" form
        tensor = tensor.view(merged)
    if tuple(tensor.shape) != merged:
        raise UsageError(_not_merged(name, shape, merged, ours))
    return tensor.transpose(1, 2).contiguous()


def _not_merged(name: str, shape: Tuple[int, ...], merged: Tuple[int, ...], ours: Tuple[int, ...]) -> str:
    return (f"model.model_name_or_path: {name} has shape {shape}, neither MindSpeed's merged-expert layout "
            f"({merged} or {(merged[0] * merged[1], merged[2])}, moe_hf_param_merge_experts.sh) nor {ours} — point "
            f"model_name_or_path at the original HF directory (per-expert weights), or re-run MindSpeed's "
            f"tests/tools/fsdp2/moe_hf_param_merge_experts.sh on it")
