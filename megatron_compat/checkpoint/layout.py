"""What a Megatron-LM checkpoint directory looks like, told from its file names alone (torch-free: resume points and
validation ask it before anything is read).

Layout facts (megatron-core 0.16.1 ``dist_checkpointing``, Megatron-LM ``megatron/training/checkpointing.py``:
``get_checkpoint_name``, ``_get_checkpoint_format``):

- ``ROOT/latest_checkpointed_iteration.txt`` holds an iteration (or ``release``); its directory is
  ``ROOT/iter_{it:07d}`` (or ``ROOT/release``).
- ``torch_dist``: ``metadata.json`` (``sharded_backend: torch_dist``), ``common.pt`` and PyTorch DCP files
  (``.metadata``, ``*.distcp``).
- ``torch_dcp`` (and Megatron-FSDP's ``fsdp_dtensor``, told apart by the saved args: `fsdp_dtensor`): DCP files only,
  without ``metadata.json`` (nor this project's ``checkpoint_meta.json``, which makes one of ours).
- legacy ``torch``: ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` (or ``model_rng.pt``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from fsdp2_backend.checkpoint.dirs import LATEST_FILE, META_FILE  # the same marker name as Megatron-LM's

ITER_RE = re.compile(r"^iter_\d+$")
LEGACY_RE = re.compile(r"^mp_rank_(\d\d)(?:_(\d\d\d))?(?:_(\d\d\d))?$")  # tp[, pp][, ep]: get_checkpoint_name


def is_plain_dcp(it_dir: Path) -> bool:
    """A DCP directory without torch_dist's metadata.json (nor this project's own checkpoint_meta.json, which
    makes one of its own checkpoints): Megatron-LM's torch_dcp (or fsdp_dtensor) format."""
    return (it_dir / ".metadata").is_file() and not any((it_dir / n).is_file() for n in ("metadata.json", META_FILE))


def checkpoint_format(it_dir: Path) -> Optional[str]:
    """``torch_dist``, ``torch`` (legacy) or ``torch_dcp`` (also Megatron-FSDP's ``fsdp_dtensor``: `dcp_format`)
    for a Megatron-LM iteration directory, else None."""
    if not it_dir.is_dir():
        return None
    if is_plain_dcp(it_dir):
        return "torch_dcp"
    meta = it_dir / "metadata.json"
    if meta.is_file() and (it_dir / ".metadata").is_file():
        try:
            backend = json.loads(meta.read_text()).get("sharded_backend")
        except (ValueError, AttributeError):
            return None
        return "torch_dist" if backend == "torch_dist" else None
    if any(LEGACY_RE.match(c.name) and any((c / n).is_file() for n in ("model_optim_rng.pt", "model_rng.pt"))
           for c in it_dir.iterdir() if c.is_dir()):
        return "torch"
    return None


def megatron_iteration_dir(path: os.PathLike | str) -> Optional[Path]:
    """The iteration directory a Megatron-LM ``--load`` would read from ``path`` (a save root with the latest
    marker, or one ``iter_*`` / ``release`` directory), or None when ``path`` holds no Megatron-LM checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return None
    if checkpoint_format(path):
        return path
    marker = path / LATEST_FILE
    if marker.is_file():
        text = marker.read_text().strip()
        it_dir = path / ("release" if text == "release" else f"iter_{int(text):07d}")
        return it_dir if checkpoint_format(it_dir) else None
    iters = sorted((c for c in path.iterdir() if ITER_RE.match(c.name) and checkpoint_format(c)),
                   key=lambda c: int(c.name[5:]))
    return iters[-1] if iters else None


__all__ = ["LATEST_FILE", "is_plain_dcp", "checkpoint_format", "megatron_iteration_dir"]
