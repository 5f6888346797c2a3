"""On-disk layout of our checkpoints: naming, atomic visibility, discovery, rotation, per-rank RNG files.

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

Atomicity rests on one rename: a checkpoint is written under ``iter_0000010.tmp`` and renamed to
``iter_0000010`` only after every rank has finished writing, so a directory with the final name is
always complete; a kill at any moment leaves at worst a ``.tmp`` directory that no loader looks at
(and that the next run deletes). Rotation renames a directory away before deleting it, for the same
reason. The ``latest`` marker is written (atomically) after the rename and, as in Megatron, decides which
checkpoint a run resumes from — the last one this run committed, even when a directory with a higher
iteration sits next to it (a ``--finetune`` run saving into its ``--load`` directory). Only when the
marker is missing or names no complete checkpoint does the newest complete directory win; a kill between
rename and marker therefore resumes from the checkpoint before, which is complete too.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from usage_errors import UsageError

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "checkpoint_meta.json"
TRAIN_STATE_FILE = "train_state.json"
RUN_CONFIG_FILE = "run_config.json"
SCHEDULER_FILE = "scheduler.pt"
EXTRA_FILE = "extra_state.pt"
HF_META_DIR = "hf_meta"
RNG_DIR = "rng"
FORMAT = "fsdp2-dcp-v1"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_SUFFIX = ".tmp"
_DELETING_SUFFIX = ".deleting"


def print_rank0(line: str) -> None:
    """User-facing checkpoint lines (Megatron's among them), on stdout of rank 0 as print_rank_0 writes."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def iter_dir_name(iteration: int) -> str:
    """Megatron's directory name for an iteration: ``iter_0000010``."""
    return f"iter_{iteration:07d}"


def tmp_dir_for(final_dir: Path) -> Path:
    return final_dir.with_name(final_dir.name + _TMP_SUFFIX)


def is_complete_checkpoint(path: os.PathLike | str) -> bool:
    """True for a directory with a final ``iter_*`` name holding our metadata (only a rename makes one)."""
    path = Path(path)
    return bool(_ITER_RE.match(path.name)) and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: os.PathLike | str) -> list[tuple[int, Path]]:
    """The complete checkpoints directly under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _ITER_RE.match(child.name)
        if match and is_complete_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def read_latest_marker(root: os.PathLike | str) -> Optional[int]:
    """The iteration named by ``latest_checkpointed_iteration.txt``, or None (absent or unreadable)."""
    try:
        return int((Path(root) / LATEST_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def write_latest_marker(root: Path, iteration: int) -> None:
    """Replaces the marker atomically (write a temporary file, fsync, rename)."""
    tmp = root / (LATEST_FILE + _TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)


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


def find_resume_checkpoint(load_dir: Optional[str], save_dir: Optional[str]) -> Optional[Path]:
    """Where a run resumes from, or None (then ``load_dir``, if any, holds HF weights to start from).

    A restart of the same command must continue its own run, so ``save_dir``'s newest complete checkpoint
    (see ``newest_checkpoint``) wins; otherwise ``load_dir`` when it holds one of our checkpoints (a root
    with ``iter_*`` dirs, or an ``iter_*`` dir itself). Partial (``.tmp``) checkpoints are never returned.
    """
    for source, directory in (("save", save_dir), ("load", load_dir)):
        if not directory:
            continue
        found = resolve_checkpoint(directory)
        if found is None:
            _refuse_foreign_checkpoint(Path(directory), source)
        if found is not None:
            print_rank0(f"resuming from the newest complete checkpoint {found} (found under the {source} "
                        f"directory)")
            return found
    return None


def _refuse_foreign_checkpoint(root: Path, source: str) -> None:
    """A Megatron-LM (or other) checkpoint where ours would be: starting fresh there would silently ignore
    it and overwrite its latest marker, so stop and say what to do."""
    if not root.is_dir():
        return
    foreign = sorted(child.name for child in root.iterdir() if _ITER_RE.match(child.name) and child.is_dir())
    if foreign or (root / LATEST_FILE).is_file():
        flag = "--save / training.output_dir" if source == "save" else "--load / model.model_name_or_path"
        raise UsageError(f"{flag}: {root} holds a checkpoint this backend did not write "
                         f"({foreign[-1] if foreign else LATEST_FILE} without {META_FILE}; a Megatron-LM "
                         f"checkpoint?) — convert it to Hugging Face format, --load that directory and --save "
                         f"to a new one")


def is_restart(checkpoint: os.PathLike | str, save_dir: Optional[str]) -> bool:
    """True when ``checkpoint`` lies in ``save_dir``: a restart of this run (``--finetune`` must not reset it)."""
    return bool(save_dir) and Path(checkpoint).resolve().parent == Path(save_dir).resolve()


def choose_resume(load_dir: Optional[str], save_dir: Optional[str], resume_from_checkpoint: Optional[str] = None,
                  finetune: bool = False) -> tuple[Optional[Path], bool]:
    """The trainer's one call: (checkpoint to load or None, whether to load it as ``--finetune``).

    An explicit ``resume_from_checkpoint`` (an ``iter_*`` dir, or a dir whose newest one is taken) wins and
    must hold a complete checkpoint; otherwise ``find_resume_checkpoint``. ``finetune`` applies to a
    checkpoint from elsewhere only: a restart of this run continues it instead of resetting it again.
    """
    if resume_from_checkpoint:
        found = resolve_checkpoint(resume_from_checkpoint)
        if found is None:
            raise UsageError(f"training.resume_from_checkpoint: {resume_from_checkpoint} holds no complete "
                             f"checkpoint (an iter_* directory with {META_FILE}) — point it at an iter_* "
                             f"directory or at the --save directory of a run, or unset it")
        print_rank0(f"resuming from {found} (resume_from_checkpoint)")
    else:
        found = find_resume_checkpoint(load_dir, save_dir)
    if found is None:
        return None, False
    return found, finetune and not is_restart(found, save_dir)


def remove_stale_partials(root: Path) -> None:
    """Deletes ``.tmp`` / ``.deleting`` leftovers of a killed run (rank 0, before any rank saves)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.is_dir() and child.name.endswith((_TMP_SUFFIX, _DELETING_SUFFIX)):
            logger.warning("removing partial checkpoint %s left by an interrupted run", child)
            shutil.rmtree(child, ignore_errors=True)


def commit(tmp_dir: Path, final_dir: Path, iteration: int, save_total_limit: Optional[int]) -> None:
    """Makes a fully written checkpoint visible, then moves the marker, then rotates (rank 0 only)."""
    _fsync_dir(tmp_dir)
    if final_dir.exists():  # an older save of this iteration (a finetune run saving where it loaded from)
        _delete(final_dir)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    write_latest_marker(final_dir.parent, iteration)
    if save_total_limit is not None and save_total_limit > 0:
        rotate(final_dir.parent, save_total_limit, keep_path=final_dir)


def rotate(root: Path, keep: int, keep_path: Path) -> None:
    """Keeps ``keep_path`` (the one just committed) and the newest others, ``keep`` in all."""
    others = [path for _, path in complete_checkpoints(root) if path != keep_path]
    for path in others[:max(len(others) - (keep - 1), 0)]:
        _delete(path)


def _delete(path: Path) -> None:
    # Renamed away first: a kill mid-delete never leaves a half-deleted directory under a final name.
    doomed = path.with_name(path.name + _DELETING_SUFFIX)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    # Durability of the rename itself on POSIX file systems; a no-op where directories cannot be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.pt"


def _device_module():
    """The torch module of the current accelerator (torch.cuda, torch.npu, ...), or None on CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.get_device_module(accelerator) if accelerator is not None else None


def capture_rng_state() -> dict[str, Any]:
    """This rank's RNG states as plain values and tensors (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached),
        "torch_cpu": torch.get_rng_state(),
    }
    module = _device_module()
    if module is not None:
        state["device"] = module.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_cpu"])
    module = _device_module()
    if module is not None and "device" in state:
        module.set_rng_state(state["device"])
