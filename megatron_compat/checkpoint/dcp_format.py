"""Megatron-LM's ``--ckpt-format torch_dcp`` checkpoints read back into the dict Megatron-LM saved (and
Megatron-FSDP's ``fsdp_dtensor`` saves, put in the same form).

Layout facts (Megatron-LM ``megatron/training/checkpointing.py``: ``generate_state_dict``, ``save_checkpoint``'s
``CheckpointType.GLOBAL`` branch, ``_get_checkpoint_format``):

- ``iter_*/`` holds only PyTorch DCP files (``.metadata``, ``__*_*.distcp``): no ``metadata.json`` and no
  ``common.pt`` (those make a ``torch_dist`` save), no ``mp_rank_*`` (the legacy ``torch`` format).
- It is ``torch.distributed.checkpoint.save`` of the whole dict ``generate_state_dict`` builds for the legacy
  format: ``args``, ``checkpoint_version``, ``iteration``, ``model`` (``state_dict_for_save_checkpoint()``: one
  key per layer, as the legacy format; under torch FSDP2 DTensors, stored as global tensors), ``optimizer``
  (the optimizer's ``state_dict()``: torch's, indexed by parameter), ``opt_param_scheduler``, ``rng_state`` (a
  list of per-rank dicts), ``rerun_state_machine``. DCP's default planner flattens it: every tensor and every
  other leaf is one entry (``model.decoder.layers.0.mlp.linear_fc1.weight``, ``optimizer.optimizer.state.0.exp_avg``,
  ``rng_state.0.np_rng_state``, ...), the leaves pickled; ``.metadata``'s ``planner_data`` maps each entry to its
  path in the dict (strings for dict keys — an int key such as a parameter index comes back as its string —
  ints for list positions).
- ``fsdp_dtensor`` (Megatron-FSDP, ``--use-megatron-fsdp``) writes the same kind of files after
  ``preprocess_fsdp_dtensor_state_dict``: told apart by the saved args (``ckpt_format`` / ``use_megatron_fsdp``),
  as Megatron-LM itself does, and put back into the legacy form here (`fsdp_dtensor`: wrapper prefixes, SwiGLU
  halves; its optimizer state is read by `fsdp_dtensor.optimizer_state`).

Every pickled leaf and ``.metadata`` are read through `safe_pickle`'s allow-list.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.checkpoint.fsdp_dtensor import is_fsdp_dtensor, join_halves, model_state, rng_entries
from megatron_compat.checkpoint.safe_pickle import dcp_load, dcp_metadata


def _rebuild(flat: dict, paths: dict) -> dict:
    """The nested dict DCP flattened: dict keys from strings, list positions from ints."""
    root: dict = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node):  # list positions
        return [node[i] for i in sorted(node)]
    return node


def _int_keys(state: dict) -> dict:
    """torch optimizer state keyed by parameter index again (DCP stored the indices as strings)."""
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state.items()}


def read_flat_entries(it_dir: Path, keep=lambda key: True) -> dict[str, Any]:
    """The DCP entries whose key passes ``keep``, flat (tensors, and pickled objects such as the RNG's
    ShardedObject, unpickled through the allow-list), read without a process group."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    flat: dict[str, Any] = {}
    for key, meta in dcp_metadata(it_dir).state_dict_metadata.items():
        if not keep(key):
            continue
        if isinstance(meta, TensorStorageMetadata):
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            flat[key] = io.BytesIO()
    if flat:
        dcp_load(flat, it_dir)
    return flat


def read_dcp_entries(it_dir: Path, keep=lambda key: True) -> dict:
    """The saved dict (nested, as Megatron-LM built it) restricted to the DCP entries whose key passes ``keep``."""
    metadata = dcp_metadata(it_dir)
    flat = read_flat_entries(it_dir, keep)
    saved = _rebuild(flat, metadata.planner_data if isinstance(metadata.planner_data, dict) else {})
    optimizer = saved.get("optimizer")
    if isinstance(optimizer, dict):
        inner = optimizer.get("optimizer", optimizer)
        if isinstance(inner, dict) and isinstance(inner.get("state"), dict):
            inner["state"] = _int_keys(inner["state"])
    return saved


def model_shapes(it_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors as meta tensors (shapes only), in Megatron's names, in the order they were saved."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp_metadata(it_dir)
    shapes = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
              for key, meta in metadata.state_dict_metadata.items()
              if key.startswith("model.") and isinstance(meta, TensorStorageMetadata) and "_extra_state" not in key}
    return join_halves(shapes, it_dir) if is_fsdp_dtensor(read_dcp_common(it_dir).get("args")) else shapes


def read_dcp_common(it_dir: Path) -> dict:
    """Everything but the model and optimizer tensors (args, iteration, scheduler, RNG)."""
    saved = read_dcp_entries(it_dir, lambda key: not key.startswith(("model.", "optimizer.")))
    if is_fsdp_dtensor(saved.get("args")) and "rng_state" in saved:
        saved["rng_state"] = rng_entries(saved["rng_state"])
    return saved


def read_dcp_checkpoint(it_dir: Path, with_optimizer: bool = True) -> dict:
    """The dict a torch_dcp save holds (``model``: {name: tensor}, per layer); an fsdp_dtensor save's model and RNG
    in the same form (its ``optimizer`` as saved: `fsdp_dtensor.optimizer_state`)."""
    saved = read_dcp_entries(it_dir, lambda key: with_optimizer or not key.startswith("optimizer."))
    fsdp = is_fsdp_dtensor(saved.get("args"))
    if fsdp and "rng_state" in saved:
        saved["rng_state"] = rng_entries(saved["rng_state"])
    model = saved.get("model")
    if not isinstance(model, dict) or not model:
        raise UsageError(f"{it_dir}: a DCP checkpoint without Megatron-LM's 'model' entries (model0, model1, ...: a "
                         f"virtual-pipeline save is not read) — re-save it with --ckpt-format torch_dist")
    saved["model"] = model_state(model) if fsdp else {k: v for k, v in model.items()
                                                      if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    return saved


__all__ = ["read_flat_entries", "read_dcp_entries", "model_shapes", "read_dcp_common", "read_dcp_checkpoint"]
