"""Writing our checkpoints: atomic visibility, the latest marker, rotation, and why a save failed. Torch-free;
the names of a save directory and finding a checkpoint in it are `fsdp2_backend/checkpoint/dirs.py`'s (which
draws the layout); the per-rank RNG files are `rng_state`'s. `storage_error` finds what made a save fail (a full
disk, a lost permission) for the one-line report.

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

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from fsdp2_backend.checkpoint.atomic import publish, write_atomically
from fsdp2_backend.checkpoint.dirs import LATEST_FILE, complete_checkpoints

logger = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
_DELETING_SUFFIX = ".deleting"


def tmp_dir_for(final_dir: Path) -> Path:
    return final_dir.with_name(final_dir.name + _TMP_SUFFIX)


def write_latest_marker(root: Path, iteration: int) -> None:
    """Replaces the marker atomically (`atomic.write_atomically`)."""
    write_atomically(root / LATEST_FILE, str(iteration))


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
    if final_dir.exists():  # an older save of this iteration (a finetune run saving where it loaded from)
        _delete(final_dir)
    publish(tmp_dir, final_dir)  # every file and the directory fsync'd, one rename, the parent fsync'd
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


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------------------------------ failed saves
_SHORT_WRITE = re.compile(r"unexpected pos|write.*fail|fail.*writ", re.IGNORECASE)


def storage_error(exc: BaseException, directory: Optional[Path] = None) -> Optional[OSError]:
    """The OSError (a full disk, a lost permission, a read-only file system) behind a failed save, or None: DCP
    wraps the writers' exceptions (CheckpointException: {rank: failure}) and chains them. torch.save's zip writer
    reports a short write without the errno ("unexpected pos 704 vs 598"): then a probe write into `directory`
    finds the cause (ENOSPC, EFBIG, ...)."""
    found = _chained_os_error(exc)
    if found is not None or directory is None or not _SHORT_WRITE.search(_messages(exc)):
        return found
    probe = Path(directory) / f".write_probe_{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (4 * 2**20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        return probe_error
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return OSError(errno.ENOSPC, "a write was cut short: no space left on the device, or a file-size limit")


def _messages(exc: BaseException) -> str:
    text, todo, seen = [], [exc], set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        text.append(str(current))
        todo += [current.__cause__, current.__context__, getattr(current, "exception", None)]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [_failure(f) for f in failures.values()]
    return "\n".join(text)


def _chained_os_error(exc: BaseException) -> Optional[OSError]:
    seen, todo = set(), [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        todo += [current.__cause__, current.__context__, getattr(current, "exception", None)]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [_failure(f) for f in failures.values()]
    return None


def _failure(wrapped) -> Optional[BaseException]:
    """One rank's failure in DCP's CheckpointException: (exception, stack summary), or an exception."""
    if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
        return wrapped[0]
    return wrapped if isinstance(wrapped, BaseException) else getattr(wrapped, "exception", None)
