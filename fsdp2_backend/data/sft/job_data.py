"""The SFT data as `build.build` uses it: the same shape as the pretraining data (train loader, datasets) plus
the evaluation hook the trainer calls (`evaluate(trainer, final)` → {set name: loss}).

Preparation (tokenizing, packing) runs once per build, however often `build` asks for the data (it asks once to
count an epoch's iterations, then again at the restored consumed samples). Evaluation: every set, whole, on every
evaluation (LLaMA-Factory evaluates its full eval set each time), each rank its share, reduced over the
data-parallel ranks; one Megatron validation block per set, so `eval_on_each_dataset` prints a loss line per
dataset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch


@dataclass
class SFTJobData:
    train_loader: Any                       # iterable: an endless stream of this rank's micro-batches
    datasets: Tuple[Any, Any, Any]          # (train rows or None when streaming, None, None)
    valid_loader: Any = None
    test_loader: Any = None
    evaluate: Optional[Callable] = None


class _Endless:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return self.batches


def sft_data_builder(config, tokenizer, ctx, state) -> Callable[[int], SFTJobData]:
    """`build_data(iters)` for build.py: the SFT data at the state's consumed samples."""
    from fsdp2_backend.data.sft.pipeline import build_sft_data, eval_loaders

    prepared: Dict[str, Any] = {}

    def build_data(_iters: int) -> SFTJobData:
        data = build_sft_data(config, tokenizer, ctx.dp_rank, ctx.dp_size, state.consumed_train_samples,
                              prepared=prepared)
        rows = data.train_samples
        loaders = eval_loaders(data, config, ctx.dp_rank, ctx.dp_size) if data.eval_sets else {}
        evaluate = (lambda trainer, final=False: evaluate_sets(trainer, loaders, final)) if loaders else None
        return SFTJobData(_Endless(data.train_batches), (range(rows) if rows is not None else None, None, None),
                          evaluate=evaluate)

    return build_data


@torch.no_grad()
def evaluate_sets(trainer, loaders: Dict[str, Any], final: bool) -> Dict[str, float]:
    """Token-weighted loss of each evaluation set; logs one validation block per set."""
    trainer.model.eval()
    losses = {}
    for name, loader in loaders.items():
        totals = torch.zeros(2, dtype=torch.float64, device=trainer.device)
        for batch in loader:
            loss_sum, count, _ = trainer._forward_loss(batch)
            totals += torch.stack([loss_sum.double(), count.double()])
        trainer._all_reduce(totals)
        losses[name] = (totals[0] / totals[1].clamp(min=1)).item()
    iteration = trainer.state.iteration
    with trainer.logger.paused():
        for name, loss in losses.items():
            split = f"eval set {name}" if len(losses) > 1 or name != "eval" else ("validation set" if final else "")
            trainer.logger.validation(iteration, {"lm loss": loss}, trainer.state.consumed_valid_samples, split)
    trainer.model.train()
    return losses
