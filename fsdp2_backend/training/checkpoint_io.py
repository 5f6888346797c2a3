"""On-disk layout of our checkpoints: naming, atomic visibility, discovery, rotation. Torch-free
(config validation reads a checkpoint's model config through it); the per-rank RNG files are `rng_state`'s.
`storage_error` finds what made a save fail (a full disk, a lost permission) for the one-line report.

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

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple, Optional

from fsdp2_backend.usage_errors import UsageError

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "checkpoint_meta.json"
TRAIN_STATE_FILE = "train_state.json"
RUN_CONFIG_FILE = "run_config.json"
SCHEDULER_FILE = "scheduler.pt"
EXTRA_FILE = "extra_state.pt"
HF_META_DIR = "hf_meta"
FORMAT = "fsdp2-dcp-v1"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_SUFFIX = ".tmp"
_DELETING_SUFFIX = ".deleting"


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


def foreign_checkpoint(root: os.PathLike | str) -> Optional[str]:
    """What a directory holds when it is a checkpoint this backend did not write (a Megatron-LM one), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    iters = sorted(child for child in root.iterdir() if _ITER_RE.match(child.name) and child.is_dir())
    if _ITER_RE.match(root.name):
        iters = [root]
    if not iters and not (root / LATEST_FILE).is_file():
        return None
    probe = iters[-1] if iters else root
    names = {p.name for p in probe.iterdir()} if probe.is_dir() else set()
    if "common.pt" in names or any(n.endswith(".distcp") for n in names) and META_FILE not in names:
        kind = "a Megatron-LM distributed (torch_dist) checkpoint"
    elif any(n.startswith("mp_rank_") for n in names):
        kind = "a Megatron-LM legacy (mp_rank_*) checkpoint"
    else:
        kind = f"a checkpoint this backend did not write ({probe.name} without {META_FILE})"
    return kind


class ResumePoint(NamedTuple):
    """Where a run starts: the checkpoint to load (None: from the model's weights or from scratch), whether it
    loads as --finetune (weights only, iteration 0), and a line saying why, for the log."""

    checkpoint: Optional[Path]
    finetune: bool
    reason: str

    @property
    def megatron(self) -> bool:
        """`checkpoint` is a Megatron-LM iteration directory (megatron_compat/checkpoint/resume.py), not one of ours."""
        return self.checkpoint is not None and not is_complete_checkpoint(self.checkpoint)


def resume_point(save_dir: Optional[str], resume_from_checkpoint: Optional[str], model_dir: Optional[str] = None,
                 finetune: bool = False) -> ResumePoint:
    """Decides where a run starts, reading only the file system (no torch, no printing; call it anywhere).

    1. An explicit `resume_from_checkpoint` naming one complete `iter_*` checkpoint.
    2. The newest complete checkpoint under `save_dir`: a restart of the same command continues its own run
       (so a `--finetune` restart does not reset it again).
    3. `resume_from_checkpoint` naming a save directory (Megatron's `--load`): its newest checkpoint; a directory
       that holds none yet, or does not exist yet, starts the run from scratch, as Megatron's --load does.
    4. `model_dir` (model_name_or_path) when it is one of our checkpoints instead of an HF directory.
    A Megatron-LM checkpoint (torch_dist or legacy) in any of these places resumes as Megatron-LM would; another
    foreign one is refused with what it is.
    """
    def refuse_foreign(path, flag):
        kind = foreign_checkpoint(path)
        if kind:
            from megatron_compat.checkpoint.convert import megatron_iteration_dir  # imports torch

            it_dir = megatron_iteration_dir(path)
            if it_dir is not None:
                return ResumePoint(it_dir, finetune, f"resuming from the Megatron-LM checkpoint {it_dir} ({flag})"
                                   + (" for finetuning" if finetune else ""))
            raise UsageError(f"{flag}: {path} holds {kind} that cannot be read (incomplete: no metadata.json and "
                             f".metadata, no mp_rank_*/model_optim_rng.pt) — point it at a complete checkpoint, or "
                             f"--save elsewhere")

    explicit = Path(resume_from_checkpoint) if resume_from_checkpoint else None
    if explicit is not None and _ITER_RE.match(explicit.name):
        if not is_complete_checkpoint(explicit):
            megatron = refuse_foreign(explicit, "training.resume_from_checkpoint (--load)")
            if megatron is not None:
                return megatron
            raise UsageError(f"training.resume_from_checkpoint (--load): {explicit} is not a complete checkpoint "
                             f"(no {META_FILE} or .metadata: an interrupted save?) — give another iter_* directory "
                             f"or the save directory itself")
        return ResumePoint(explicit, finetune and not is_restart(explicit, save_dir),
                           f"resuming from {explicit} (resume_from_checkpoint)")
    if save_dir:
        found = newest_checkpoint(save_dir)
        if found is not None:
            return ResumePoint(found, False, f"resuming from the newest complete checkpoint {found} (found under "
                                             f"the save directory)")
        megatron = refuse_foreign(save_dir, "training.output_dir (--save)")
        if megatron is not None:
            return megatron
    if explicit is not None:
        found = newest_checkpoint(explicit)
        if found is not None:
            return ResumePoint(found, finetune and not is_restart(found, save_dir),
                               f"resuming from the newest complete checkpoint {found} (found under {explicit})")
        megatron = refuse_foreign(explicit, "training.resume_from_checkpoint (--load)")
        if megatron is not None:
            return megatron
        return ResumePoint(None, False, f"no checkpoint found in {explicit}: training starts from scratch (as "
                                        f"Megatron's --load does)")
    if model_dir and Path(model_dir).is_dir() and not (Path(model_dir) / "config.json").is_file():
        found = resolve_checkpoint(model_dir)
        if found is not None:
            return ResumePoint(found, finetune and not is_restart(found, save_dir),
                               f"resuming from the newest complete checkpoint {found} (found under the model "
                               f"directory)")
        megatron = refuse_foreign(model_dir, "model.model_name_or_path (--load)")
        if megatron is not None:
            return megatron
    return ResumePoint(None, False, "")


def is_restart(checkpoint: os.PathLike | str, save_dir: Optional[str]) -> bool:
    """True when ``checkpoint`` lies in ``save_dir``: a restart of this run (``--finetune`` must not reset it)."""
    return bool(save_dir) and Path(checkpoint).resolve().parent == Path(save_dir).resolve()


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
