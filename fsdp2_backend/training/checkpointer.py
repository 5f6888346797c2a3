"""The run's one checkpointer: it owns the states a checkpoint holds and the run's resume point.

    checkpointer = Checkpointer(config, resume_point(...), states={"model": model, "optimizer": optimizer,
                                "scheduler": scheduler, "train_state": state, "loss_scaler": scaler},
                                tokenizer=, model_config=)      # every rank (collective)
    checkpointer.load()                        # restores every state from the resume point, if there is one
    checkpointer.save(iteration, reason)       # "interval" / "exit" / "final"
    checkpointer.close()                       # waits for an async save, releases its process group

States, by name: the model and optimizer (DCP, resharded to any layout), the scheduler, the train state (iteration,
consumed samples), and any other object with state_dict / load_state_dict (the loss scaler) saved beside them;
per-rank RNG too. The tokenizer and model config are written beside them so a checkpoint describes itself.
`save_checkpoints: false` (Megatron without --save) makes `save` a no-op while `load` still resumes. After the save
that finishes training ("final", or an exit at the last iteration) the HF export (`save_hf_weights`) is written to
OUTPUT_DIR/hf. Where to resume from and in which format: `fsdp2_backend.checkpoint` (`resume_point`, `formats`);
our format and commit protocol: `checkpoint` and `fsdp2_backend.checkpoint.commit`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from fsdp2_backend.checkpoint.hf_export import align_special_tokens, export_hf
from fsdp2_backend.checkpoint.resume_point import ResumePoint

HF_EXPORT_SUBDIR = "hf"
# The states with a place of their own in a checkpoint; any other named state is saved in extra_state.pt.
_OWN_PLACES = ("model", "optimizer", "scheduler", "train_state")


class Checkpointer:
    """Loads and saves one run's states; construct it on every rank."""

    def __init__(self, config, resume: ResumePoint, *, states: Dict[str, Any], tokenizer: Any = None,
                 model_config: Any = None, guard: Any = None):
        if states.get("model") is None:
            raise ValueError("Checkpointer: states needs the 'model'")
        self.config, self.resume = config, resume
        self.states = {name: obj for name, obj in states.items() if obj is not None}
        self.model = self.states["model"]
        self.hf_tokenizer = getattr(tokenizer, "hf", None)  # the run's tokenizer type; None: not saveable as HF
        self.model_config = model_config
        if not config.model.model_name_or_path and (config.model.architecture or {}).get("model_type"):
            # built from flags: special token ids from the tokenizer, not the model type's defaults
            align_special_tokens(model_config, tokenizer, getattr(self.model, "generation_config", None))
        self.guard = guard  # save_dir_guard.SaveDirGuard: the save directory's lock, released by close()
        training = config.training
        if training.save_checkpoints:
            # torch.distributed.checkpoint (~0.1 s to import) only for a run that saves or resumes
            from fsdp2_backend.training.checkpoint import CheckpointManager
        self.manager: Optional["CheckpointManager"] = CheckpointManager(
            training.output_dir, save_total_limit=training.save_total_limit, async_save=training.save_async,
            save_only_model=training.save_only_model, no_save_optim=training.no_save_optim,
            no_save_rng=training.no_save_rng) if training.save_checkpoints else None
        self._exported_iteration: Optional[int] = None

    @property
    def last_saved(self) -> Optional[int]:
        """The iteration of the newest checkpoint this run has saved, or None."""
        return self.manager.last_saved if self.manager is not None else None

    def _extra_states(self) -> dict:
        return {name: obj for name, obj in self.states.items() if name not in _OWN_PLACES}

    def load(self) -> None:
        """Restores every state from the resume point (collective); nothing to do for a fresh run.
        --no-load-optim / --no-load-rng skip those parts; --finetune loads the weights only (iteration 0)."""
        if self.resume.checkpoint is None:
            return
        training, fmt, get = self.config.training, self.resume.format, self.states.get
        if fmt.reshards_in_place:  # ours: DCP loads each rank's shards straight into the run
            from fsdp2_backend.training.checkpoint import load_checkpoint

            # the train state (a TrainState: load_state_dict) is restored in place
            load_checkpoint(self.resume.checkpoint, self.model, get("optimizer"), get("scheduler"),
                            get("train_state"), no_load_optim=training.no_load_optim,
                            no_load_rng=training.no_load_rng, finetune=self.resume.finetune,
                            extra_states=self._extra_states())
            return
        # another format (Megatron-LM's): read as plain full tensors by its Format, applied here
        import torch.distributed as dist

        from fsdp2_backend.training.megatron_continuation import apply_megatron_state

        state = fmt.read(self.resume.checkpoint, load_optim=get("optimizer") is not None and not training.no_load_optim,
                         load_rng=not training.no_load_rng, finetune=self.resume.finetune,
                         rank=dist.get_rank() if dist.is_initialized() else 0)
        apply_megatron_state(state, self.model, get("optimizer"), get("scheduler"), get("train_state"),
                             get("loss_scaler"))

    def save(self, iteration: int, reason: str, train_iters: Optional[int] = None) -> None:
        """Saves every state at `iteration` (collective); `reason` "exit" / "final" also waits for the write.
        Training has finished at "final" or at an exit with `iteration >= train_iters`: then the HF export."""
        if self.manager is None:
            return
        get = self.states.get
        self.manager.save(iteration, self.model, get("optimizer"), get("scheduler"), get("train_state"),
                          tokenizer=self.hf_tokenizer, model_config=self.model_config,
                          run_config=self.config.to_dict(), extra_states=self._extra_states())
        if reason in ("exit", "final"):
            self.manager.wait()
        finished = reason == "final" or (train_iters is not None and iteration >= train_iters)
        # The last iteration may also be a save interval: then "interval" already exported, and "final" must not
        # gather and write the same weights again.
        if finished and self.config.training.save_hf_weights and self._exported_iteration != iteration:
            self._export(iteration)

    def export_if_missing(self, iteration: int) -> bool:
        """A finished run resumed (its rerun): writes the HF export only when the earlier run's is missing (an
        export that failed: a full disk), without saving the checkpoint again. True when it wrote one."""
        if self.manager is None or not self.config.training.save_hf_weights or self._export_dir().is_dir():
            return False
        self._export(iteration)
        return True

    def _export_dir(self) -> Path:
        return Path(self.config.training.output_dir) / HF_EXPORT_SUBDIR

    def _export(self, iteration: int) -> None:
        self._exported_iteration = iteration
        export_hf(self.model, self._export_dir(), self.hf_tokenizer)

    def close(self) -> None:
        """Waits for a pending async save and releases the manager's resources (every rank)."""
        try:
            if self.manager is not None:
                self.manager.finalize()
                self.manager = None
        finally:
            if self.guard is not None:
                self.guard.release()
