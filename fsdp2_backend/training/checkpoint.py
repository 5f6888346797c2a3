"""Saving and resuming training checkpoints with torch.distributed.checkpoint (DCP).

Owns what goes into a checkpoint and when it becomes visible: the sharded model and optimizer (through
``get_state_dict`` / ``set_state_dict``, so FSDP2/TP DTensors reshard on load to any number of ranks), the
LR scheduler, per-rank RNG states and the trainer's state (iteration, consumed samples, ...), plus the
model config and tokenizer so that a checkpoint describes itself. The layout and the atomic commit live in
``fsdp2_backend.checkpoint.commit``; the HF export in ``fsdp2_backend.checkpoint.hf_export``.

Flags follow Megatron: ``no_save_optim`` drops optimizer *and* scheduler, ``no_load_optim`` skips both,
``no_load_rng`` skips RNG, ``finetune`` loads model weights only and leaves the trainer's state fresh
(iteration 0, no consumed samples). ``save_only_model`` (the seed's field) saves model weights, trainer
state and self-description only.

Async saves: ``dcp.async_save`` stages a CPU copy of the state in the calling thread (that copy is the
only stall) and runs the whole DCP save, collectives included, in a background thread. Those
collectives use a gloo process group of their own, created once here, so they never interleave with the
training loop's collectives on the default group. DCP gathers every rank's write result on rank 0 before
it writes ``.metadata``, so when rank 0's save finishes every rank has written: rank 0 then renames the
checkpoint into place (in a committer thread for async saves) with no further collective.

The run's one checkpointer (the states it owns, load / save / HF export) is ``checkpointer``; where a run
resumes from is ``fsdp2_backend.checkpoint.resume_point``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from fsdp2_backend.usage_errors import RunStopped, UsageError
from fsdp2_backend.checkpoint import commit as io
from fsdp2_backend.checkpoint import dirs
from fsdp2_backend.distributed.console import print_rank0
from fsdp2_backend.training import rng_state
from fsdp2_backend.checkpoint.hf_export import save_tokenizer

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _agree_failed(failed: bool) -> bool:
    """Whether any rank failed (collective; a barrier too): every rank then stops at the same point."""
    if not dist.is_initialized():
        return failed
    backend = dist.get_backend()
    device = "cpu" if backend == "gloo" else torch.accelerator.current_accelerator()
    flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def train_state_to_dict(train_state: Any) -> dict:
    """The trainer's state as a JSON-able dict (accepts a dataclass, an object with state_dict(), a dict)."""
    if train_state is None:
        return {}
    if hasattr(train_state, "state_dict"):
        return dict(train_state.state_dict())
    if dataclasses.is_dataclass(train_state):
        return dataclasses.asdict(train_state)
    return dict(train_state)


def train_state_from_dict(train_state: Any, saved: dict) -> Any:
    """Restores ``saved`` into (a copy of) ``train_state``, keeping fields the checkpoint does not know."""
    if train_state is None:
        return dict(saved)
    if hasattr(train_state, "load_state_dict"):
        train_state.load_state_dict(saved)
        return train_state
    if dataclasses.is_dataclass(train_state):
        names = {f.name for f in dataclasses.fields(train_state)}
        return dataclasses.replace(train_state, **{k: v for k, v in saved.items() if k in names})
    return {**train_state, **saved}


class CheckpointManager:
    """Writes checkpoints under ``save_dir``; construct it on every rank (it may create a process group).

    ``save()`` at every save interval and at exit, ``finalize()`` before the process ends (waits for an
    async save and commits it).
    """

    def __init__(self, save_dir: str | os.PathLike, *, save_total_limit: Optional[int] = None,
                 async_save: bool = False, save_only_model: bool = False, no_save_optim: bool = False,
                 no_save_rng: bool = False):
        self.save_dir = Path(save_dir)
        self.save_total_limit = save_total_limit
        self.async_save = async_save
        self.save_optim = not (save_only_model or no_save_optim)
        self.save_scheduler = self.save_optim
        self.save_rng = not (save_only_model or no_save_rng)
        self._pending: Optional[Future] = None
        self._pending_iteration: Optional[int] = None
        self._last_saved: Optional[int] = None
        self._pending_tmp: Optional[Path] = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit") \
            if async_save and _rank() == 0 else None
        # A group of our own for the background save's collectives (gloo: DCP's async path needs CPU).
        self._async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        if _rank() == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            io.remove_stale_partials(self.save_dir)
        _barrier()

    @classmethod
    def from_training_args(cls, training) -> "CheckpointManager":
        """From ``Config.training`` (output_dir, save_total_limit, save_async, save_only_model, no_save_*)."""
        return cls(training.output_dir, save_total_limit=training.save_total_limit,
                   async_save=training.save_async, save_only_model=training.save_only_model,
                   no_save_optim=training.no_save_optim, no_save_rng=training.no_save_rng)

    @property
    def last_saved(self) -> Optional[int]:
        """The iteration of the newest checkpoint this manager has committed, or None."""
        return self._last_saved

    def _stop(self, iteration: int, tmp_dir: Path, error: Optional[OSError]) -> None:
        """A save that failed for want of space or permission: drop its partial directory, keep every complete
        checkpoint (the commit never happened), and stop the run with one line."""
        if _rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        previous = dirs.newest_checkpoint(self.save_dir)
        kept = (f"the previous checkpoint {previous.name} is intact" if previous is not None
                else "no earlier checkpoint exists there")
        why = f"{error.strerror or error}" if error is not None else "a write failed on another rank"
        raise RunStopped(f"training.output_dir (--save): saving the checkpoint of iteration {iteration} to "
                         f"{self.save_dir} failed ({why}) — {kept}; free space or fix permissions there, then rerun "
                         f"the same command to resume")

    # ----------------------------------------------------------------------------------------- saving
    def save(self, iteration: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             scheduler: Any = None, train_state: Any = None, tokenizer: Any = None,
             model_config: Any = None, extra_states: Optional[dict] = None,
             run_config: Optional[dict] = None) -> Optional[Path]:
        """Saves a checkpoint of ``iteration`` (collective); returns its final path, None if already saved.

        ``extra_states``: more optimizer-side objects with state_dict/load_state_dict, equal on every rank
        (e.g. {"loss_scaler": scaler}); saved and loaded like the scheduler. ``run_config``: the run's
        configuration (``Config.to_dict()``), kept as run_config.json for people and tools.

        With ``async_save`` it returns once the state is staged in CPU memory; the checkpoint appears
        under its final name when the background write has finished everywhere.
        """
        if iteration in (self._last_saved, self._pending_iteration):
            return None  # e.g. the exit save right after an interval save
        self.wait()
        started = time.perf_counter()
        print_rank0(f"saving checkpoint at iteration {iteration:7d} to {self.save_dir} in {dirs.FORMAT} format")
        final_dir = self.save_dir / dirs.iter_dir_name(iteration)
        tmp_dir = io.tmp_dir_for(final_dir)
        rank = _rank()
        with_optim = optimizer is not None and self.save_optim
        error: Optional[OSError] = None
        try:  # this rank's own files; a failure is shared with the others only after DCP's collectives
            tmp_dir.mkdir(parents=True, exist_ok=True)  # every rank: no barrier needed before writing
            if self.save_rng:
                rng_state.rng_file(tmp_dir, rank).parent.mkdir(exist_ok=True)
                torch.save(rng_state.capture_rng_state(), rng_state.rng_file(tmp_dir, rank))
            if rank == 0:
                self._write_rank0_files(tmp_dir, iteration, model, with_optim, scheduler, train_state, tokenizer,
                                        model_config, extra_states, run_config)
        except Exception as exc:  # torch.save wraps the OSError in a RuntimeError
            error = io.storage_error(exc, self.save_dir)
            if error is None:
                raise
        if with_optim:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}

        if self.async_save:
            if _agree_failed(error is not None):
                self._stop(iteration, tmp_dir, error)
            future = dcp.async_save(state, checkpoint_id=str(tmp_dir), process_group=self._async_group)
            upload = getattr(future, "upload_completion", future)  # AsyncSaveResponse in newer torch
            self._pending = self._committer.submit(self._finish, upload, tmp_dir, final_dir, iteration) \
                if rank == 0 else upload
            self._pending_iteration = iteration
            self._pending_tmp = tmp_dir
            print_rank0(f"  checkpoint {final_dir.name}: staged in {time.perf_counter() - started:.2f}s, "
                           "writing in the background")
        else:
            try:
                dcp.save(state, checkpoint_id=str(tmp_dir))  # every rank, even after a local failure
            except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any writer failed
                error = error or io.storage_error(exc, self.save_dir)
                if error is None:
                    raise
            if rank == 0 and error is None:
                try:
                    self._commit(tmp_dir, final_dir, iteration)
                except OSError as exc:
                    error = exc
            if _agree_failed(error is not None):  # the barrier after the commit
                self._stop(iteration, tmp_dir, error)
            self._last_saved = iteration
            print_rank0(f"  checkpoint {final_dir.name} saved in {time.perf_counter() - started:.2f}s")
        return final_dir

    def _finish(self, upload: Future, tmp_dir: Path, final_dir: Path, iteration: int) -> None:
        upload.result()  # rank 0's save returns after all ranks' writes and the .metadata file
        self._commit(tmp_dir, final_dir, iteration)

    def _commit(self, tmp_dir: Path, final_dir: Path, iteration: int) -> None:
        io.commit(tmp_dir, final_dir, iteration, self.save_total_limit)
        # Megatron's line, printed once the marker is written (log watchers key on it).
        print(f"  successfully saved checkpoint from iteration {iteration:7d} to {self.save_dir}", flush=True)

    def _write_rank0_files(self, tmp_dir: Path, iteration: int, model, with_optim: bool, scheduler, train_state,
                           tokenizer, model_config, extra_states, run_config) -> None:
        io.write_json(tmp_dir / dirs.TRAIN_STATE_FILE, {**train_state_to_dict(train_state), "iteration": iteration})
        if scheduler is not None and self.save_scheduler:
            torch.save(scheduler.state_dict(), tmp_dir / dirs.SCHEDULER_FILE)
        if extra_states and self.save_optim:
            torch.save({name: obj.state_dict() for name, obj in extra_states.items()}, tmp_dir / dirs.EXTRA_FILE)
        if run_config is not None:
            io.write_json(tmp_dir / dirs.RUN_CONFIG_FILE, run_config)
        hf_meta = tmp_dir / dirs.HF_META_DIR
        hf_meta.mkdir(exist_ok=True)
        save_tokenizer(tokenizer, hf_meta)
        model_config = model_config if model_config is not None else getattr(model, "config", None)
        if model_config is not None:
            model_config.save_pretrained(str(hf_meta))
        io.write_json(tmp_dir / dirs.META_FILE, {
            "format": dirs.FORMAT, "iteration": iteration, "world_size": _world_size(),
            "has_optimizer": with_optim, "has_scheduler": scheduler is not None and self.save_scheduler,
            "has_rng": self.save_rng, "torch_version": torch.__version__,
        })

    def wait(self) -> None:
        """Blocks until a pending async save is written and committed (collective when one is pending)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        iteration, self._pending_iteration = self._pending_iteration, None
        error = None
        try:
            pending.result()
        except (Exception, CheckpointException) as exc:
            error = io.storage_error(exc, self.save_dir)
            if error is None:
                raise
        if _agree_failed(error is not None):
            self._stop(iteration, self._pending_tmp, error)
        self._last_saved = iteration

    def finalize(self) -> None:
        """Waits for the last async save and releases the manager (no save after it); call on every rank
        before the process group is destroyed."""
        self.wait()
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None


# -------------------------------------------------------------------------------------------------- loading
def checkpoint_meta(checkpoint: str | os.PathLike) -> dict:
    """What a checkpoint holds: format, iteration, world_size, has_optimizer, has_scheduler, has_rng."""
    return io.read_json(Path(checkpoint) / dirs.META_FILE)


def checkpoint_hf_dir(checkpoint: str | os.PathLike) -> Path:
    """The directory in a checkpoint with config.json and the tokenizer files (AutoConfig/AutoTokenizer)."""
    return Path(checkpoint) / dirs.HF_META_DIR


def _guarded_reading(checkpoint: Path) -> dict:
    """DCP's reader and planner reading .metadata and the pickled entries (the optimizer's param groups) through the
    allow-list foreign checkpoints go through (megatron_compat/checkpoint/safe_pickle.py): a checkpoint directory
    from elsewhere runs no code."""
    from megatron_compat.checkpoint.safe_pickle import OWN, SafeFileSystemReader, SafeLoadPlanner

    return {"storage_reader": SafeFileSystemReader(str(checkpoint), kind=OWN),
            "planner": SafeLoadPlanner(checkpoint, kind=OWN)}


def load_checkpoint(checkpoint: str | os.PathLike, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None,
                    train_state: Any = None, *, no_load_optim: bool = False, no_load_rng: bool = False,
                    finetune: bool = False, extra_states: Optional[dict] = None) -> Any:
    """Loads a complete checkpoint into an already sharded model (collective); returns the train state.

    Any number of ranks can load what any number saved. ``train_state`` is the trainer's fresh state:
    returned restored from the checkpoint, or unchanged with ``finetune``. Parts the checkpoint lacks
    (saved with ``save_only_model`` / ``no_save_optim`` / ``no_save_rng``) are skipped with a warning.
    """
    checkpoint = Path(checkpoint)
    meta = checkpoint_meta(checkpoint)
    if meta.get("format") != dirs.FORMAT:
        raise UsageError(f"{checkpoint}: checkpoint format {meta.get('format')!r}, expected {dirs.FORMAT!r} — "
                         f"load it with the version that wrote it, or convert it to HF and start from that")
    print_rank0(f" loading checkpoint from {checkpoint.parent} at iteration {meta['iteration']}")
    started = time.perf_counter()
    load_optim = optimizer is not None and not (no_load_optim or finetune)
    if load_optim and not meta["has_optimizer"]:
        logger.warning("%s holds no optimizer state: the optimizer starts fresh", checkpoint)
        load_optim = False

    if load_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, **_guarded_reading(checkpoint))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, **_guarded_reading(checkpoint))
        set_model_state_dict(model, state["model"])

    if scheduler is not None and not (no_load_optim or finetune):
        if meta["has_scheduler"]:
            scheduler.load_state_dict(torch.load(checkpoint / dirs.SCHEDULER_FILE, weights_only=True))
        else:
            logger.warning("%s holds no scheduler state: the scheduler starts fresh", checkpoint)
    if extra_states and not (no_load_optim or finetune):
        saved = torch.load(checkpoint / dirs.EXTRA_FILE, weights_only=True) if (checkpoint / dirs.EXTRA_FILE).is_file() \
            else {}
        for name, obj in extra_states.items():
            if name in saved:
                obj.load_state_dict(saved[name])
            else:
                logger.warning("%s holds no %s state: it starts fresh", checkpoint, name)

    if not (no_load_rng or finetune):
        _load_rng(checkpoint, meta)

    print_rank0(f"  loaded {checkpoint.name} in {time.perf_counter() - started:.2f}s (saved by "
                   f"{meta['world_size']} ranks, loaded by {_world_size()})"
                   + (" for finetuning: iteration reset to 0" if finetune else ""))
    print_rank0(f"  successfully loaded checkpoint from {checkpoint.parent} at iteration "
                 f"{0 if finetune else meta['iteration']}")
    if finetune:
        return train_state
    return train_state_from_dict(train_state, io.read_json(checkpoint / dirs.TRAIN_STATE_FILE))


def _load_rng(checkpoint: Path, meta: dict) -> None:
    path = rng_state.rng_file(checkpoint, _rank())
    if not meta["has_rng"]:
        logger.warning("%s holds no RNG state: RNG states are left as they are", checkpoint)
    elif not path.is_file():
        # More ranks now than at save time: these ranks keep their seeded streams.
        logger.warning("%s has no RNG state for rank %d (saved by %d ranks)", checkpoint, _rank(),
                       meta["world_size"])
    else:
        rng_state.restore_rng_state(torch.load(path, weights_only=True))
