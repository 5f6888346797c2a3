"""Where a run starts: its own newest checkpoint, the one `--load` names, or none (`resume_point`), read from the
file system alone (no torch, no printing: validation and the build both ask). The checkpoint's kind is its
`formats.Format` (`ResumePoint.format`): this backend's own, or a Megatron-LM one, which resumes as Megatron-LM
would; another foreign directory is refused with what it is.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Optional

from fsdp2_backend.checkpoint.dirs import (ITER_RE, LATEST_FILE, META_FILE, is_complete_checkpoint, newest_checkpoint,
                                           resolve_checkpoint)
from fsdp2_backend.checkpoint.formats import Format, detect_format
from fsdp2_backend.config.schema import Config
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.checkpoint.layout import megatron_iteration_dir


def foreign_checkpoint(root: os.PathLike | str) -> Optional[str]:
    """What a directory holds when it is a checkpoint this backend did not write (a Megatron-LM one), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    iters = sorted(child for child in root.iterdir() if ITER_RE.match(child.name) and child.is_dir())
    if ITER_RE.match(root.name):
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
    def format(self) -> Optional[Format]:
        """The checkpoint's `formats.Format` (ours, or one of Megatron-LM's), None without a checkpoint: what
        validation, the build and the checkpointer ask about it (its model config, model arguments, reader)."""
        return detect_format(self.checkpoint)


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
            it_dir = megatron_iteration_dir(path)
            if it_dir is not None:
                return ResumePoint(it_dir, finetune, f"resuming from the Megatron-LM checkpoint {it_dir} ({flag})"
                                   + (" for finetuning" if finetune else ""))
            raise UsageError(f"{flag}: {path} holds {kind} that cannot be read (incomplete: no metadata.json and "
                             f".metadata, no mp_rank_*/model_optim_rng.pt) — point it at a complete checkpoint, or "
                             f"--save elsewhere")

    explicit = Path(resume_from_checkpoint) if resume_from_checkpoint else None
    if explicit is not None and ITER_RE.match(explicit.name):
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
