"""A run with Megatron's --rampup-batch-size on one rank: it reads exactly the samples a Megatron run would (the
dataset's samples in order, each step's count from megatron-core 0.16.1's calculator), its learning rate follows
megatron-core's scheduler stepped by those counts, it saves when the micro-batches change (as Megatron's loop does),
prints each step's global batch size, and a run stopped mid-ramp and resumed prints the straight run's lines."""
import re
import types

import pytest
import torch

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.config.validation import validate
from megatron_compat.translate import translate_megatron
from tests.support.save_recorder import SaveRecorder

GBS, MBS, RAMP, TRAIN_SAMPLES = 8, 2, [2, 2, 20], 64
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 "
         f"--global-batch-size {GBS} --rampup-batch-size {' '.join(map(str, RAMP))} --train-samples {TRAIN_SAMPLES} "
         "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-samples 8 --lr-decay-samples 60 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu --normalization RMSNorm "
         "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--attention-dropout 0 --hidden-dropout 0 --log-interval 1 --save-interval 100 --eval-iters 0").split()


def _megatron_steps():
    """[(consumed before, global batch, micro-batches)] of Megatron's steps: megatron-core's calculator, and the
    length of Megatron-LM's update_train_iters (ramp phase while consumed <= ramp samples, then whole batches)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calculator = RampupBatchsizeNumMicroBatchesCalculator(GBS, MBS, 1, False, 1, *RAMP)
    steps, consumed = [], 0
    while consumed <= RAMP[2] and consumed <= TRAIN_SAMPLES:
        calculator.update(consumed, consistency_check=True)
        steps.append((consumed, calculator.get_current_global_batch_size(), calculator.get()))
        consumed += calculator.get_current_global_batch_size()
    steps += [(consumed + k * GBS, GBS, GBS // MBS) for k in range((TRAIN_SAMPLES - consumed) // GBS)]
    return steps


def _megatron_lrs(steps):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = types.SimpleNamespace(param_groups=[{"params": []}])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=8,
                                        lr_decay_steps=60, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=TRAIN_SAMPLES, wd_incr_style="constant")
    lrs = []
    for _, gbs, _ in steps:
        scheduler.step(increment=gbs)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def _config(save_dir, *extra):
    translation = translate_megatron(FLAGS + ["--save", str(save_dir), *extra])
    return validate(Config(**{g: GROUPS[g](**v) for g, v in translation.fields.items()}), 1)


def _train(config, recorder=None, seen=None):
    """Builds and trains in this process; returns (TrainResult, printed lines). With `recorder`, the job's
    checkpointer is replaced by it; with `seen`, every micro-batch's (iteration, tokens) is appended."""
    from fsdp2_backend.build import build
    from fsdp2_backend.training.trainer import Trainer

    job = build(config)
    lines = []
    try:
        job.logger.print_fn = lines.append
        if recorder is not None:
            job.checkpointer.close()
            job.checkpointer = recorder
        trainer = Trainer(job)
        if seen is not None:
            batches = job.train_batches

            def recording():
                for batch in batches:
                    seen.append((trainer.state.iteration, batch["tokens"]))
                    yield batch

            trainer.train_batches = recording()
        return trainer.train(), lines, job
    finally:
        job.close()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    seen, recorder = [], SaveRecorder()
    config = _config(tmp_path_factory.mktemp("straight"))
    result, lines, job = _train(config, recorder, seen)
    return dict(config=config, result=result, lines=lines, seen=seen, saves=recorder.saves, job=job)


def test_ramp_up_reads_megatrons_samples_with_megatrons_lr(straight):
    from fsdp2_backend.data.pretrain import build_pretrain_data

    steps, result, job = _megatron_steps(), straight["result"], straight["job"]
    assert job.train_iters == len(steps) == 12
    dataset = build_pretrain_data(straight["config"], job.tokenizer, 0, 1, 0, GBS, MBS, 12).datasets[0]
    assert result.state.consumed_train_samples == sum(gbs for _, gbs, _ in steps) == 62
    for k, (consumed, gbs, micro_batches) in enumerate(steps):
        rows = [tokens for iteration, tokens in straight["seen"] if iteration == k]
        assert len(rows) == micro_batches, k
        expected = torch.stack([torch.as_tensor(dataset[i]["tokens"]) for i in range(consumed, consumed + gbs)])
        assert torch.equal(torch.cat(rows), expected.to(rows[0].dtype)), k
    assert result.learning_rates == pytest.approx(_megatron_lrs(steps), rel=1e-9, abs=0)
    # Megatron saves before the first step whose micro-batches differ from the previous step's
    changes = [k for k in range(1, len(steps)) if steps[k][2] != steps[k - 1][2]]
    assert straight["saves"] == [(k, "interval") for k in changes] + [(12, "final")] and changes == [4, 6, 7]


LINE = re.compile(r" iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*? global batch size:\s+(\d+) \|"
                  r".*? lm loss: ([0-9.E+-]+) \|")


def _printed(lines):
    return {int(m[0]): (int(m[1]), int(m[2]), int(m[3]), m[4]) for m in LINE.findall("\n".join(lines))}


def test_log_lines_show_each_steps_batch_and_a_resume_mid_ramp_equals_the_straight_run(straight, tmp_path):
    steps = _megatron_steps()
    printed = _printed(straight["lines"])
    assert {it: row[:3] for it, row in printed.items()} == {
        k + 1: (12, consumed + gbs, gbs) for k, (consumed, gbs, _) in enumerate(steps)}
    first, first_lines, _ = _train(_config(tmp_path, "--exit-interval", "5"))  # at 12 samples: batch 4 of 2..8
    second, second_lines, _ = _train(_config(tmp_path))  # resumes from iteration 5's checkpoint
    assert sorted(_printed(first_lines)) == list(range(1, 6)) and sorted(_printed(second_lines)) == list(range(6, 13))
    assert {**_printed(first_lines), **_printed(second_lines)} == printed  # consumed, batch and printed loss
    assert first.losses + second.losses == straight["result"].losses
