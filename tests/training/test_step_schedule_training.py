"""Megatron-LM's own gpt3 175b line shape on one rank: --step-batch-size-schedule with --global-batch-size and
--train-iters. Each step runs the batch of the last threshold at or below the samples consumed before it (Megatron's
StepBatchsizeNumMicroBatchesCalculator; not in megatron-core 0.16.1, so the sizes are counted here by hand from its
documented rule), the run lasts --train-iters steps, the learning rate is megatron-core 0.16.1's scheduler with
Megatron's iteration counts in samples (iters x --global-batch-size) stepped by each step's batch, the ignored
--global-batch-size is said once, and a run stopped mid-schedule and resumed prints the straight run's lines."""
import re
import types

import pytest

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.config.validation import validate_with_notices
from megatron_compat.translate import translate_megatron

GBS, MBS, ITERS = 12, 2, 13
# thresholds in tokens (seq 32): 0, 10 and 30 samples
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 64 --micro-batch-size 2 --step-batch-size-schedule 0:2 320:4 960:8 "
         f"--global-batch-size {GBS} --train-iters {ITERS} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 2 --lr-decay-iters 11 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
         "--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--attention-dropout 0 --hidden-dropout 0 --log-interval 1 --save-interval 100 --eval-iters 0").split()
# by hand: 2-sample steps at 0 2 4 6 8, 4-sample steps at 10 14 18 22 26, then 8-sample steps from 30
SIZES = [2] * 5 + [4] * 5 + [8] * 3


def _config(save_dir, *extra):
    translation = translate_megatron(FLAGS + ["--save", str(save_dir), *extra])
    return validate_with_notices(Config(**{g: GROUPS[g](**v) for g, v in translation.fields.items()}), 1)


def _train(config):
    from fsdp2_backend.build import build
    from fsdp2_backend.training.trainer import Trainer

    job = build(config)
    try:
        lines = []
        job.logger.print_fn = lines.append
        return Trainer(job).train(), lines, job.train_iters
    finally:
        job.close()


def _megatron_lrs():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = types.SimpleNamespace(param_groups=[{"params": []}])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2 * GBS,
                                        lr_decay_steps=11 * GBS, lr_decay_style="cosine", start_wd=0.01,
                                        end_wd=0.01, wd_incr_steps=ITERS * GBS, wd_incr_style="constant")
    lrs = []
    for size in SIZES:
        scheduler.step(increment=size)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


LINE = re.compile(r" iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*? global batch size:\s+(\d+) \|"
                  r".*? lm loss: ([0-9.E+-]+) \|")


def _printed(lines):
    return {int(m[0]): (int(m[1]), int(m[2]), int(m[3]), m[4]) for m in LINE.findall("\n".join(lines))}


def test_steps_follow_the_schedule_for_train_iters_and_a_resume_continues_it(tmp_path):
    config, notices = _config(tmp_path / "straight")
    assert [n for n in notices if n.startswith("training.global_batch_size")] == [
        f"training.global_batch_size: {GBS} is ignored for the training steps when using "
        "training.step_batch_size_schedule (each step's batch comes from the schedule, as Megatron's calculator "
        "warns); it is read where Megatron reads args.global_batch_size: the data and the lr / weight-decay schedule "
        "of a run by iterations (max_steps x it samples) and the evaluation batch"]
    result, lines, train_iters = _train(config)
    consumed = [sum(SIZES[:k + 1]) for k in range(ITERS)]
    printed = _printed(lines)
    assert train_iters == ITERS and result.state.consumed_train_samples == consumed[-1] == 54
    assert {it: row[:3] for it, row in printed.items()} == {
        k + 1: (ITERS, consumed[k], SIZES[k]) for k in range(ITERS)}
    assert result.learning_rates == pytest.approx(_megatron_lrs(), rel=1e-9, abs=0)
    first, first_lines, _ = _train(_config(tmp_path / "resumed", "--exit-interval", "7")[0])  # mid 4-sample steps
    second, second_lines, _ = _train(_config(tmp_path / "resumed")[0])
    assert sorted(_printed(first_lines)) == list(range(1, 8)) and sorted(_printed(second_lines)) == list(range(8, 14))
    assert {**_printed(first_lines), **_printed(second_lines)} == printed  # consumed, batch and printed loss
    assert first.learning_rates + second.learning_rates == pytest.approx(result.learning_rates, rel=1e-12, abs=0)
