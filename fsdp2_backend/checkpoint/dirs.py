"""Where a checkpoint of ours is: the save directory's names and their discovery. Torch-free and printing nothing,
so config validation (a checkpoint's model config, `hf_meta/config.json`), the checkpointer, generation and the
tools all read it; where a run resumes is `resume_point`'s, writing one (atomic visibility, rotation) `commit`'s.

A save directory looks like Megatron's::

    SAVE_DIR/latest_checkpointed_iteration.txt   # "10": written last, a Megatron-style pointer
    SAVE_DIR/iter_0000010/                        # one complete checkpoint
        .metadata, __0_0.distcp, ...              # torch.distributed.checkpoint: "model" (+ "optimizer")
        checkpoint_meta.json                      # format, iteration, world size, what is inside
        train_state.json                          # iteration, consumed samples, ... (the trainer's state)
        run_config.json                           # the run's configuration, for people and tools
        scheduler.pt                              # the LR scheduler's state_dict
        extra_state.pt                            # other optimizer-side states, by name (loss scaler)
        rng/rank_00000.pt                         # python / numpy / torch cpu / device RNG, one file per rank
        hf_meta/config.json, tokenizer files      # self-description: the model config and the tokenizer

A directory with a final ``iter_*`` name is complete (only a rename after every rank has written makes one). The
``latest`` marker decides which checkpoint a run resumes from — the last one its run committed, even when a
directory with a higher iteration sits next to it (a ``--finetune`` run saving into its ``--load`` directory).
Only when the marker is missing or names no complete checkpoint does the newest complete directory win. Other
formats (Hugging Face, Megatron-LM's) are told apart by `formats`.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional


logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "checkpoint_meta.json"
TRAIN_STATE_FILE = "train_state.json"
RUN_CONFIG_FILE = "run_config.json"
SCHEDULER_FILE = "scheduler.pt"
EXTRA_FILE = "extra_state.pt"
HF_META_DIR = "hf_meta"
FORMAT = "fsdp2-dcp-v1"
ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    """Megatron's directory name for an iteration: ``iter_0000010``."""
    return f"iter_{iteration:07d}"


def is_complete_checkpoint(path: os.PathLike | str) -> bool:
    """True for a directory with a final ``iter_*`` name holding our metadata (only a rename makes one)."""
    path = Path(path)
    return bool(ITER_RE.match(path.name)) and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: os.PathLike | str) -> list[tuple[int, Path]]:
    """The complete checkpoints directly under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = ITER_RE.match(child.name)
        if match and is_complete_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def read_latest_marker(root: os.PathLike | str) -> Optional[int]:
    """The iteration named by ``latest_checkpointed_iteration.txt``, or None (absent or unreadable)."""
    try:
        return int((Path(root) / LATEST_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def newest_checkpoint(root: os.PathLike | str) -> Optional[Path]:
    """The checkpoint to resume from under ``root``: the marker's when it names a complete one, else the
    complete one with the highest iteration, else None."""
    root = Path(root)
    marker = read_latest_marker(root)
    if marker is not None and is_complete_checkpoint(root / iter_dir_name(marker)):
        return root / iter_dir_name(marker)
    found = complete_checkpoints(root)
    if not found:
        return None
    if marker is not None:
        logger.warning("%s names iteration %s, which is not a complete checkpoint; using %s", LATEST_FILE,
                       marker, found[-1][1].name)
    return found[-1][1]


def resolve_checkpoint(path: os.PathLike | str) -> Optional[Path]:
    """``path`` itself when it is a complete checkpoint, else the newest one under it, else None."""
    path = Path(path)
    if is_complete_checkpoint(path):
        return path
    return newest_checkpoint(path)
