"""Where a checkpoint of ours is: the save directory's names and their discovery, and where a run resumes.
Torch-free and printing nothing, so config validation (a checkpoint's model config, `hf_meta/config.json`), the
checkpointer, generation and the tools all read it; writing one (atomic visibility, rotation) is
`checkpoint/commit.py`'s.

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
Only when the marker is missing or names no complete checkpoint does the newest complete directory win. A
Megatron-LM checkpoint is recognised here and read by `megatron_compat/checkpoint/`.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

from fsdp2_backend.config.schema import Config
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


def iter_dir_name(iteration: int) -> str:
    """Megatron's directory name for an iteration: ``iter_0000010``."""
    return f"iter_{iteration:07d}"


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


def resume_checkpoint(config: Config) -> ResumePoint:
    """The run's resume point (`resume_point`), from the file system; raises UsageError for a
    checkpoint this backend cannot read (e.g. Megatron-LM's)."""
    t = config.training
    return resume_point(t.output_dir if t.save_checkpoints else None, t.resume_from_checkpoint,
                        config.model.model_name_or_path, t.finetune)
