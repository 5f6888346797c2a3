"""The trainer-facing glue of checkpointing: from a `Config` to a manager, a resume plan and a save hook.

`run_training` needs three calls (all ranks):

    manager = checkpoint_manager(config)                       # None without --save (save_checkpoints false)
    checkpoint, finetune = resume_plan(config)                  # before the model is built: where it comes from
    ...build and shard the model (from checkpoint_hf_dir(checkpoint) when --load holds no HF weights)...
    state = resume(config, checkpoint, finetune, model, optimizer, scheduler, state, extra_states)
    Trainer(..., save_hook=trainer_save_hook(manager, config, tokenizer, hf_config))

The hook saves at every call ("interval", "exit", "final"), waits for an async save and releases the
manager at "exit" and "final", and writes the HF export (`save_hf_weights`) to OUTPUT_DIR/hf when training
has finished ("final", or an exit at the last iteration).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from fsdp2_backend.training import checkpoint_io as io
from fsdp2_backend.training.checkpoint import CheckpointManager, load_checkpoint
from fsdp2_backend.training.hf_export import export_hf

HF_EXPORT_SUBDIR = "hf"


def checkpoint_manager(config) -> Optional[CheckpointManager]:
    """The run's manager (collective: construct on every rank), or None when checkpoints are off."""
    if not config.training.save_checkpoints:
        return None
    return CheckpointManager.from_training_args(config.training)


def resume_plan(config) -> tuple[Optional[Path], bool]:
    """(checkpoint to resume from or None, whether to load it as --finetune): see ``choose_resume``."""
    training = config.training
    save_dir = training.output_dir if training.save_checkpoints else None
    return io.choose_resume(config.model.model_name_or_path, save_dir, training.resume_from_checkpoint,
                            training.finetune)


def resume(config, checkpoint: Optional[Path], finetune: bool, model, optimizer, scheduler, state: Any,
           extra_states: Optional[dict] = None) -> Any:
    """Loads ``checkpoint`` (when there is one) with the run's --no-load-optim / --no-load-rng; returns the
    trainer state to start from."""
    if checkpoint is None:
        return state
    return load_checkpoint(checkpoint, model, optimizer, scheduler, state,
                           no_load_optim=config.training.no_load_optim, no_load_rng=config.training.no_load_rng,
                           finetune=finetune, extra_states=extra_states)


def trainer_save_hook(manager: Optional[CheckpointManager], config, tokenizer: Any = None,
                      model_config: Any = None) -> Optional[Callable]:
    """A ``Trainer.save_hook(trainer, reason)`` saving model, optimizer, scheduler, ``trainer.state`` and
    ``trainer.loss_scaler``, with the model config, tokenizer and run config inside."""
    if manager is None:
        return None

    def hook(trainer, reason: str) -> None:
        manager.save(trainer.state.iteration, trainer.model, trainer.optimizer, trainer.scheduler, trainer.state,
                     tokenizer=tokenizer, model_config=model_config, run_config=config.to_dict(),
                     extra_states={"loss_scaler": trainer.loss_scaler})
        if reason in ("exit", "final"):
            manager.finalize()
        finished = reason == "final" or trainer.state.iteration >= trainer.train_iters
        if finished and config.training.save_hf_weights:
            export_hf(trainer.model, Path(config.training.output_dir) / HF_EXPORT_SUBDIR, tokenizer)

    return hook


def training_hooks(config) -> tuple[Callable, Optional[Callable]]:
    """(resume_hook, save_hook) for `run_training`: resume from the newest complete checkpoint (or the one the
    config names), save at every save point, finalize async saves and export to HF at the end.

    The manager is created lazily at the first save point, which every rank reaches together (its creation
    is collective).
    """
    captured: dict = {}

    def resume_hook(*, model, optimizer, scheduler, state, loss_scaler, tokenizer) -> None:
        captured["tokenizer"] = tokenizer
        checkpoint, finetune = resume_plan(config)
        resume(config, checkpoint, finetune, model, optimizer, scheduler, state, {"loss_scaler": loss_scaler})

    if not config.training.save_checkpoints:
        return resume_hook, None

    def save_hook(trainer, reason: str) -> None:
        if "hook" not in captured:
            captured["hook"] = trainer_save_hook(checkpoint_manager(config), config,
                                                 _hf_tokenizer(captured.get("tokenizer")),
                                                 getattr(trainer.model, "config", None))
        captured["hook"](trainer, reason)

    return resume_hook, save_hook


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The HF tokenizer inside a Megatron tokenizer wrapper (what a checkpoint and an export can save)."""
    return getattr(tokenizer, "hf", tokenizer)
