"""Hugging Face safetensors shards written from every rank, with ``model.safetensors.index.json``.

The export of a model of hundreds of billions of parameters cannot gather on one host: here the model's tensors
are split into whole groups — one per decoder layer (``model.layers.N.``) and one for the rest (embeddings,
final norm, head, MTP layers: the MTP layouts and tied weights need those together) — and the groups are dealt
to the writers by size (the largest to the least loaded). A writer keeps only its own groups' full tensors, so
its peak memory is its shard plus one tensor being gathered, not the model.

Each shard goes through the steps transformers' ``save_pretrained`` applies to a whole state dict — MTP tensors
under the checkpoint's names (``models/mtp_layouts.py``), tied weights dropped, the model's weight conversions
reverted (per-expert keys for stacked experts, a model's own on-disk names) — which all act within one group,
so the files are the ones ``save_pretrained`` would write, split differently. torch's DCP Hugging Face writer
is not used: it writes the in-memory names, without those conversions.

Shard files are named as transformers names them (``model-00001-of-00004.safetensors``; ``model.safetensors``
when there is one) and the index lists every key's file and the total size.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Dict, List, Mapping

import torch

_LAYER = re.compile(r"^model\.layers\.\d+\.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def plan_shards(sizes: Mapping[str, int], parts: int) -> List[List[str]]:
    """``parts`` lists of keys (some may be empty), each key in one, whole groups together, in ``sizes``' order
    within a list. The same answer on every rank for the same input."""
    order = {key: i for i, key in enumerate(sizes)}
    groups: Dict[str, List[str]] = {}
    for key in sizes:
        match = _LAYER.match(key)
        groups.setdefault(match.group(0) if match else "", []).append(key)
    loads, shards = [0] * parts, [[] for _ in range(parts)]
    for name, keys in sorted(groups.items(), key=lambda kv: (-sum(sizes[k] for k in kv[1]), kv[0])):
        target = min(range(parts), key=lambda j: (loads[j], j))
        shards[target].extend(keys)
        loads[target] += sum(sizes[k] for k in keys)
    return [sorted(keys, key=order.__getitem__) for keys in shards]


def shard_names(shards: List[List[str]]) -> List[str | None]:
    """The file name of each non-empty shard (None for an empty one), numbered as transformers numbers them."""
    count = sum(1 for keys in shards if keys)
    names, index = [], 0
    for keys in shards:
        if not keys:
            names.append(None)
            continue
        index += 1
        names.append(SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors")
    return names


def tied_sources(model: torch.nn.Module) -> Dict[str, int]:
    """Every parameter name → the identity of its parameter: tied names (one parameter in two modules) share it.
    The state dict's entries for tied names are distinct objects, so the parameters tell them apart."""
    return {name: id(param) for name, param in model.named_parameters(remove_duplicate=False)}


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor's numel is the global one


def unique_sizes(state_dict: Mapping[str, torch.Tensor], sources: Mapping[str, int]) -> Dict[str, int]:
    """Each key's full size in bytes, a tied duplicate counted as 0 (it is written once)."""
    seen, sizes = set(), {}
    for key, value in state_dict.items():
        source = sources.get(key, id(value))
        sizes[key] = 0 if source in seen else tensor_bytes(value)
        seen.add(source)
    return sizes


def gather_owned(state_dict: Mapping[str, torch.Tensor], shards: List[List[str]], mine: int,
                 sources: Mapping[str, int]) -> Dict[str, torch.Tensor]:
    """The full CPU tensors of shard ``mine``'s keys (collective: every rank walks the same keys in the same
    order, and each DTensor is gathered by all; a rank keeps what it owns and drops the rest at once). A tied key
    in the same shard as the name it is tied to gets the same tensor, as ``save_pretrained`` expects to find it."""
    from torch.distributed.tensor import DTensor

    owner = {key: part for part, keys in enumerate(shards) for key in keys}
    out: Dict[str, torch.Tensor] = {}
    first: Dict[int, str] = {}
    for key, value in state_dict.items():
        source = sources.get(key, id(value))
        if source in first and owner[first[source]] == owner[key]:  # tied: gathered once, under the first name
            if owner[key] == mine:
                out[key] = out[first[source]]
            continue
        first.setdefault(source, key)
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if owner[key] == mine:
            out[key] = full.detach().to("cpu")
        del full
    return out


def write_shard(model: torch.nn.Module, tensors: Dict[str, torch.Tensor], path: Path) -> Dict[str, int]:
    """Writes one shard of ``model``'s HF checkpoint (``tensors``: full tensors under the in-memory names);
    returns the written keys and their sizes in bytes."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from fsdp2_backend.models.mla_lora_scale import SCALES_ATTR, fold_scales
    from fsdp2_backend.models.mtp_layouts import to_checkpoint

    tensors = fold_scales(tensors, getattr(model, SCALES_ATTR, None))  # MLA latent scales into the weights
    tensors = to_checkpoint(tensors, model.config)
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or ():
        tensors.pop(ignored, None)
    tensors = remove_tied_weights_from_state_dict(tensors, model)
    tensors = revert_weight_conversion(model, tensors)
    tensors = {key: value.contiguous() for key, value in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    readable_by_others(path)
    return {key: tensor_bytes(value) for key, value in tensors.items()}


def readable_by_others(path: Path) -> None:
    """The mode an ordinary file gets (0666 less the umask: 0644 by default). safetensors creates its files 0600,
    unreadable to the other users of a shared file system (DESIGN.md)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_index(out_dir: Path, written: List[tuple[str, Dict[str, int]]], num_parameters: int) -> None:
    """``model.safetensors.index.json`` for the shard files (file name, its keys and sizes); none for one file."""
    if len(written) <= 1:
        return
    weight_map = {key: name for name, keys in written for key in keys}
    total = sum(size for _, keys in written for size in keys.values())
    index = {"metadata": {"total_parameters": num_parameters, "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_shards_sequentially(model: torch.nn.Module, sizes: Mapping[str, int], parts: int,
                              load: Callable[[List[str]], Dict[str, torch.Tensor]], out_dir: Path,
                              rank: int = 0, world: int = 1) -> List[tuple[str, Dict[str, int]]]:
    """One process's share of an offline conversion: the shards ``rank``, ``rank + world``, … of ``parts``,
    each read (``load(keys)``), written and freed before the next — peak memory one shard. Returns what it
    wrote (file name, keys and sizes)."""
    shards = plan_shards(sizes, parts)
    names = shard_names(shards)
    written = []
    for index in range(rank, parts, world):
        if shards[index]:
            written.append((names[index], write_shard(model, load(shards[index]), out_dir / names[index])))
    return written
