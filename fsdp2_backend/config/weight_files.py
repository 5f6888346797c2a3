"""What an HF directory's files hold, read without torch: its config.json (`read_config_json`), and its safetensors
files from their headers alone (no tensor data).

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}}),
then the tensor bytes; the format's own loader reads the same way. Reading only the header lets validation find a
truncated or corrupt file (a copy cut short) before any process group exists, and lets the model loader compare
every tensor's shape with the model the config describes before transformers reports it as a traceback.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

_MAX_HEADER = 100 * 2**20  # the format's own limit on the header size


def read_config_json(directory: Optional[str], errors: List[str]) -> Optional[Dict[str, Any]]:
    """`directory/config.json` as a dict, or None when there is none (an unreadable one is an error)."""
    path = os.path.join(directory, "config.json") if directory else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        errors.append(f"{path}: cannot read the model config ({exc}) — check the model directory")
        return None


def safetensors_files(directory: str) -> List[Path]:
    return sorted(Path(directory).glob("*.safetensors")) if directory and os.path.isdir(directory) else []


def read_header(path: Path) -> Dict[str, dict]:
    """The tensors of one file: {name: {"dtype", "shape", "data_offsets"}}; ValueError saying what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"its header claims {length} bytes but the file has {size}")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError("its header is not valid JSON") from None
    header.pop("__metadata__", None)
    end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    if 8 + length + end != size:
        raise ValueError(f"{size} bytes where its header describes {8 + length + end} (truncated or corrupt)")
    return header


def weight_file_problems(directory: str) -> List[str]:
    """One message per unreadable, truncated or corrupt *.safetensors file in `directory`."""
    problems = []
    for path in safetensors_files(directory):
        try:
            read_header(path)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            problems.append(f"model.model_name_or_path (--load): {path} cannot be read as safetensors ({exc}) — "
                            f"copy or download it again")
    return problems


def weight_shapes(directory: str) -> Dict[str, Tuple[int, ...]]:
    """{tensor name: shape} over every safetensors file of `directory` (headers only)."""
    shapes = {}
    for path in safetensors_files(directory):
        for name, entry in read_header(path).items():
            shapes[name] = tuple(entry["shape"])
    return shapes


def shape_mismatches(expected: Dict[str, Tuple[int, ...]], directory: str) -> List[str]:
    """Tensors whose stored shape differs from `expected` ({name: shape} of the model the config builds), as one
    message naming the first few; names the files do not hold are the loader's to report."""
    stored = weight_shapes(directory)
    bad = [(name, stored[name], shape) for name, shape in expected.items()
           if name in stored and tuple(stored[name]) != tuple(shape)]
    if not bad:
        return []
    shown = "; ".join(f"{name} {list(have)} (config: {list(want)})" for name, have, want in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return [f"model.model_name_or_path (--load): {len(bad)} weights in {directory} do not match the shapes its "
            f"config.json describes: {shown}{more} — use the config.json that belongs to these weights"]
