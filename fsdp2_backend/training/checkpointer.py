"""The run's one checkpointer: it owns the states a checkpoint holds and the run's resume point.

    checkpointer = Checkpointer(config, resume_point(...), model=, optimizer=, scheduler=, state=,
                                loss_scaler=, tokenizer=, model_config=)      # every rank (collective)
    checkpointer.load()                        # restores every state from the resume point, if there is one
    checkpointer.save(iteration, reason)       # "interval" / "exit" / "final"
    checkpointer.close()                       # waits for an async save, releases its process group

States: the model and optimizer (DCP, resharded to any layout), the scheduler, the train state (iteration,
consumed samples), the loss scaler, per-rank RNG; the tokenizer and model config are written beside them so a
checkpoint describes itself. `save_checkpoints: false` (Megatron without --save) makes `save` a no-op while
`load` still resumes. After the save that finishes training ("final", or an exit at the last iteration) the
HF export (`save_hf_weights`) is written to OUTPUT_DIR/hf. Format and commit protocol: `checkpoint`,
`fsdp2_backend.checkpoint.commit`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from fsdp2_backend.checkpoint.dirs import ResumePoint
from fsdp2_backend.checkpoint.hf_export import align_special_tokens, export_hf

HF_EXPORT_SUBDIR = "hf"


class Checkpointer:
    """Loads and saves one run's states; construct it on every rank."""

    def __init__(self, config, resume: ResumePoint, *, model, optimizer=None, scheduler=None, state: Any = None,
                 loss_scaler: Any = None, tokenizer: Any = None, model_config: Any = None, guard: Any = None,
                 megatron_reader: Optional[Callable[..., Any]] = None):
        self.config, self.resume = config, resume
        # A Megatron-LM resume point's reader (megatron_compat.checkpoint.resume.read_megatron_state, bound to the
        # checkpoint by the build): training applies what it reads and never imports megatron_compat.
        self.megatron_reader = megatron_reader
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.state, self.loss_scaler = state, loss_scaler
        self.hf_tokenizer = getattr(tokenizer, "hf", None)  # the run's tokenizer type; None: not saveable as HF
        self.model_config = model_config
        if not config.model.model_name_or_path and (config.model.architecture or {}).get("model_type"):
            # built from flags: special token ids from the tokenizer, not the model type's defaults
            align_special_tokens(model_config, tokenizer, getattr(model, "generation_config", None))
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
        return {"loss_scaler": self.loss_scaler} if self.loss_scaler is not None else {}

    def load(self) -> None:
        """Restores every state from the resume point (collective); nothing to do for a fresh run.
        --no-load-optim / --no-load-rng skip those parts; --finetune loads the weights only (iteration 0)."""
        if self.resume.checkpoint is None:
            return
        training = self.config.training
        if self.resume.megatron:  # a Megatron-LM checkpoint: what maps of it, read as plain state, applied here
            import torch.distributed as dist

            from fsdp2_backend.training.megatron_continuation import apply_megatron_state

            if self.megatron_reader is None:
                raise RuntimeError(f"{self.resume.checkpoint}: a Megatron-LM checkpoint, and no reader for it was "
                                   f"given to the Checkpointer (build.py binds one)")
            state = self.megatron_reader(load_optim=self.optimizer is not None and not training.no_load_optim,
                                         load_rng=not training.no_load_rng, finetune=self.resume.finetune,
                                         rank=dist.get_rank() if dist.is_initialized() else 0)
            apply_megatron_state(state, self.model, self.optimizer, self.scheduler, self.state, self.loss_scaler)
            return
        from fsdp2_backend.training.checkpoint import load_checkpoint

        # the train state (a TrainState: load_state_dict) is restored in place
        load_checkpoint(self.resume.checkpoint, self.model, self.optimizer, self.scheduler, self.state,
                        no_load_optim=training.no_load_optim, no_load_rng=training.no_load_rng,
                        finetune=self.resume.finetune, extra_states=self._extra_states())

    def save(self, iteration: int, reason: str, train_iters: Optional[int] = None) -> None:
        """Saves every state at `iteration` (collective); `reason` "exit" / "final" also waits for the write.
        Training has finished at "final" or at an exit with `iteration >= train_iters`: then the HF export."""
        if self.manager is None:
            return
        self.manager.save(iteration, self.model, self.optimizer, self.scheduler, self.state,
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
