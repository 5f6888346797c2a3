"""The loop's Megatron behaviours on one real rank: NaN/inf iterations skipped and counted, exit_interval,
validation every eval_interval, the checkpointer's save points, log cadence."""
import math

import pytest
import torch

from fsdp2_backend.config import Config
from tests.support.save_recorder import SaveRecorder
from tests.support.tiny_models import tiny_qwen3_config

SEQ, MBS, VOCAB = 16, 2, 128


def _batches(seed):
    gen = torch.Generator().manual_seed(seed)
    while True:
        text = torch.randint(0, 16, (MBS, SEQ + 1), generator=gen)
        yield dict(tokens=text[:, :-1], labels=text[:, 1:], loss_mask=torch.ones(MBS, SEQ),
                   position_ids=torch.arange(SEQ).expand(MBS, SEQ))


@pytest.fixture()
def parts(tmp_path):
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.optimizer import build_optimizer
    from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps

    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=1)).save_pretrained(tmp_path)
    config = Config()
    config.model.model_name_or_path = str(tmp_path)
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = MBS
    config.training.max_steps = 6
    config.training.lr = 1e-3
    config.training.lr_scheduler_type = "constant"
    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    optimizer = build_optimizer(model, lr=config.training.lr, weight_decay=0.0)
    scheduler = ParamScheduler(optimizer, **scheduler_steps(config.training, MBS))
    yield config, ctx, model, optimizer, scheduler
    ctx.close()


def _trainer(config, ctx, model, optimizer, scheduler, **kw):
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.training.trainer import Trainer

    job = TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=scheduler,
                   train_batches=_batches(1), train_iters=config.training.max_steps, micro_batches=1, **kw)
    return Trainer(job)


def test_nan_loss_iteration_is_skipped_and_counted(parts):
    from fsdp2_backend.training.loss import masked_loss_sum

    config, ctx, model, optimizer, scheduler = parts
    calls = []

    def poisoned(logits, labels, mask):  # the third micro-batch's loss is NaN
        calls.append(1)
        loss_sum, count = masked_loss_sum(logits, labels, mask)
        return (loss_sum * float("nan") if len(calls) == 3 else loss_sum), count

    trainer = _trainer(config, ctx, model, optimizer, scheduler, loss_fn=poisoned)
    trainer.train_step(), trainer.train_step()
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    samples_before = scheduler.num_steps
    step = trainer.train_step()
    assert step.skipped and step.got_nan and math.isnan(step.loss)
    assert all(torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))
    assert scheduler.num_steps == samples_before  # a skipped iteration does not advance the schedule
    assert all(p.grad is None for p in model.parameters())
    after = trainer.train_step()
    assert not after.skipped and math.isfinite(after.loss)
    assert not all(torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))


def test_loop_counts_exits_validates_and_saves_at_save_points(parts):
    from fsdp2_backend.training.loss import masked_loss_sum

    config, ctx, model, optimizer, scheduler = parts
    config.training.logging_steps = 2
    config.training.eval_interval = 2
    config.training.eval_iters = 3
    config.training.save_steps = 2
    config.training.exit_interval = 5
    config.training.check_for_nan_in_loss_and_grad = False  # skip the inf iteration (the default stops the run)
    from fsdp2_backend.training.logging import TrainLogger, parse_train_line

    lines, calls, recorder = [], [], SaveRecorder()
    logger = TrainLogger(train_iters=6, log_interval=2, global_batch_size=MBS, world_size=1,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=MBS * SEQ,
                         print_fn=lines.append)

    def inf_on_second(logits, labels, mask):
        calls.append(1)
        loss_sum, count = masked_loss_sum(logits, labels, mask)
        return (loss_sum + float("inf") if len(calls) == 2 else loss_sum), count

    trainer = _trainer(config, ctx, model, optimizer, scheduler, loss_fn=inf_on_second,
                       valid_batches=_batches(2), logger=logger, checkpointer=recorder)
    result = trainer.train()
    assert result.state.iteration == 5 and result.state.consumed_train_samples == 5 * MBS
    assert result.state.skipped_iterations == 1 and result.state.nan_iterations == 1
    assert result.skipped == [False, True, False, False, False]
    assert recorder.saves == [(2, "interval"), (4, "interval"), (5, "exit")]
    assert [i for i, _ in result.valid_losses] == [2, 4]
    assert result.state.consumed_valid_samples == 2 * 3 * MBS
    parsed = [parse_train_line(line) for line in lines if parse_train_line(line)]
    assert [p["iteration"] for p in parsed] == [2, 4]  # logging_steps 2
    assert (parsed[0]["skipped"], parsed[0]["nan"], parsed[1]["skipped"]) == (1, 1, 0)
    # averaged over the advanced iterations only, printed with 7 significant digits
    assert parsed[0]["losses"]["lm loss"] == pytest.approx(result.losses[0], rel=1e-6)
    assert parsed[1]["losses"]["lm loss"] == pytest.approx((result.losses[2] + result.losses[3]) / 2, rel=1e-6)
    assert parsed[1]["consumed_samples"] == 4 * MBS and parsed[1]["global_batch_size"] == MBS
    assert parsed[1]["grad_norm"] == pytest.approx(result.grad_norms[3], abs=1e-3)
    validation = [line for line in lines if "validation loss at iteration" in line]
    assert len(validation) == 2 and f"lm loss value: {result.valid_losses[0][1]:.6E}" in validation[0]
    assert result.losses[-1] < result.losses[0]


def test_bf16_mixed_precision_trains(parts):
    config, ctx, model, optimizer, scheduler = parts
    del model, optimizer, scheduler
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.optimizer import build_optimizer
    from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps

    config.parallel.param_dtype = "bf16"
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights, bf16 compute
    optimizer = build_optimizer(model, lr=config.training.lr, weight_decay=0.0)
    trainer = _trainer(config, ctx, model, optimizer, ParamScheduler(optimizer, **scheduler_steps(config.training, MBS)))
    result = trainer.train()
    assert not any(result.skipped) and result.losses[-1] < result.losses[0]


def test_fp16_loss_scale_follows_megatron_rules():
    from fsdp2_backend.training.loss_scaler import LossScaler

    assert LossScaler.for_dtype("bf16").scale == 1.0 and not LossScaler.for_dtype("fp32").dynamic
    scaler = LossScaler.for_dtype("fp16")
    scaler.window = 3
    assert scaler.scale == 2.0 ** 32
    scaler.update(True)  # hysteresis 2: the first overflow keeps the scale
    assert scaler.scale == 2.0 ** 32
    scaler.update(True)
    assert scaler.scale == 2.0 ** 31
    scaler.update(True)  # hysteresis stays spent until a growth
    assert scaler.scale == 2.0 ** 30
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 2.0 ** 31  # a clean window grows it and restores the hysteresis
    scaler.update(True)
    assert scaler.scale == 2.0 ** 31


def test_exit_duration_stops_after_saving(parts):
    config, ctx, model, optimizer, scheduler = parts
    config.training.exit_duration_in_mins = 1e-9  # already over after the first iteration
    recorder = SaveRecorder()
    trainer = _trainer(config, ctx, model, optimizer, scheduler, checkpointer=recorder)
    result = trainer.train()
    assert result.state.iteration == 1 and recorder.saves == [(1, "exit")]


def test_end_of_training_evaluates_validation_and_test_sets(parts):
    config, ctx, model, optimizer, scheduler = parts
    config.training.eval_interval = 100
    config.training.eval_iters = 1
    lines = []
    from fsdp2_backend.training.logging import TrainLogger

    logger = TrainLogger(train_iters=6, log_interval=100, global_batch_size=MBS, world_size=1,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=MBS * SEQ,
                         print_fn=lines.append)
    trainer = _trainer(config, ctx, model, optimizer, scheduler, valid_batches=_batches(2),
                       test_batches=_batches(3), logger=logger)
    trainer.train()
    ends = [line for line in lines if "validation loss at" in line]
    assert [line.split("|")[0].strip() for line in ends] == ["validation loss at iteration 6 on validation set",
                                                              "validation loss at iteration 6 on test set"]


def test_save_epochs_saves_at_epoch_boundaries(parts):
    config, ctx, model, optimizer, scheduler = parts
    config.training.save_steps = 1000
    recorder = SaveRecorder()
    trainer = _trainer(config, ctx, model, optimizer, scheduler, epoch_save_interval=2, checkpointer=recorder)
    trainer.train()
    assert recorder.saves == [(2, "interval"), (4, "interval"), (6, "interval"), (6, "final")]
