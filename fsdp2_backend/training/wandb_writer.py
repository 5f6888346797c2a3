"""Weights & Biases for a run (Megatron's --wandb-project / --wandb-exp-name / --wandb-save-dir / --wandb-entity).

`open_wandb(...)` starts the W&B run on the logging rank (Megatron: the last rank) and returns a `WandbWriter`,
which takes TensorBoard's `add_scalar(tag, value, step)` calls, so `TrainLogger` writes the same scalars to both.
Like Megatron it logs the per-iteration scalars (not the "... vs samples" twins, which W&B plots by choosing
the x axis) with the iteration as W&B's step, and the run's config. `wandb` is imported only here, only when a
project is set (the `wandb` extra).

Resuming: Megatron starts a new W&B run on every restart. Here the run id is kept in `SAVE_DIR/wandb-run-id`
(SAVE_DIR: wandb_save_dir, or output_dir/wandb as Megatron's default), and a rerun of the same command continues
that run (`wandb.init(id=..., resume="allow")`), so a resumed run's curves go on in the same chart. W&B ignores
steps at or below the last step it recorded: after a crash, the iterations between the last checkpoint and the
crash are not drawn twice.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

RUN_ID_FILE = "wandb-run-id"


class WandbWriter:
    """TensorBoard's `add_scalar` on a W&B run: one `run.log(values, step=iteration)` per iteration."""

    def __init__(self, run):
        self.run = run
        self._step: Optional[int] = None
        self._pending: Dict[str, float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if tag.endswith(" vs samples"):  # Megatron logs only the per-iteration scalars to W&B
            return
        if step != self._step:
            self.flush()
            self._step = step
        self._pending[tag] = float(value)

    def flush(self) -> None:
        if self._pending:
            self.run.log(self._pending, step=self._step)
            self._pending = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()


def wandb_dir(save_dir: Optional[str], output_dir: Optional[str]) -> str:
    """Where W&B writes: wandb_save_dir, else output_dir/wandb (Megatron's default: --save/wandb)."""
    return save_dir or os.path.join(output_dir or ".", "wandb")


def open_wandb(*, project: str, exp_name: str, save_dir: str, entity: Optional[str] = None,
               config: Optional[Dict[str, Any]] = None, print_fn: Callable[[str], None] = print) -> WandbWriter:
    """Starts (or, when SAVE_DIR holds a run id, continues) the W&B run; WANDB_MODE=offline works unchanged."""
    import wandb

    os.makedirs(save_dir, exist_ok=True)
    id_file = os.path.join(save_dir, RUN_ID_FILE)
    run_id = None
    if os.path.exists(id_file):
        with open(id_file, encoding="utf-8") as f:
            run_id = f.read().strip() or None
    run = wandb.init(project=project, name=exp_name, dir=save_dir, entity=entity or None, config=config or {},
                     id=run_id, resume="allow" if run_id else None)
    if run_id is None:
        with open(id_file, "w", encoding="utf-8") as f:
            f.write(run.id + "\n")
    else:
        print_fn(f"W&B: continuing run {run.id} (from {id_file})")
    return WandbWriter(run)
