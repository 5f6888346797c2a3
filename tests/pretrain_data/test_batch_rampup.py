"""Batch-size ramp-up arithmetic (config/batch_schedule.py) against megatron-core 0.16.1's calculators, the step
schedule against hand-computed values (it is not in megatron-core 0.16.1), and the Megatron flags' rules."""
import pytest

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.config import validation as config_validation
from fsdp2_backend.config.batch_schedule import BatchSizeSchedule, parse_step_schedule
from megatron_compat.translate import translate_megatron
from fsdp2_backend.usage_errors import UsageError

# (global batch, micro batch, data-parallel size, [start, increment, samples], decrease_batch_size_if_needed)
RAMPS = [(1024, 1, 8, [16, 8, 300000], False), (8, 2, 1, [2, 2, 20], False), (64, 4, 2, [8, 8, 1000], False),
         (30, 2, 2, [4, 2, 100], True), (96, 2, 4, [16, 16, 333], False), (12, 1, 1, [3, 3, 7], False)]


def _mcore_ramp(gbs, mbs, dp, ramp, decrease):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    return RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, decrease, 1, *ramp)


def _mcore_steps(calculator, train_samples, step_cap=100000):
    """[(consumed, current gbs, running gbs, micro-batches)] of the steps a Megatron run takes (training.py: update,
    then consumed += micro-batches x mbs x dp)."""
    steps, consumed = [], 0
    while consumed < train_samples and len(steps) < step_cap:
        calculator.update(consumed, consistency_check=False)
        running = calculator.get() * calculator.micro_batch_times_data_parallel_size
        steps.append((consumed, calculator.get_current_global_batch_size(), running, calculator.get()))
        consumed += running
    return steps


def _mcore_train_iters(calculator, train_samples, gbs, ramp_samples):
    """Megatron-LM 0.15's update_train_iters (training.py) driven by megatron-core's calculator."""
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


@pytest.mark.parametrize("gbs,mbs,dp,ramp,decrease", RAMPS)
def test_ramp_up_sizes_equal_megatron_core(gbs, ramp, mbs, dp, decrease):
    ours = BatchSizeSchedule(global_batch_size=gbs, micro_batch_size=mbs, data_parallel_size=dp, rampup=ramp,
                             decrease_if_needed=decrease)
    train_samples = ramp[2] * 2 + 3 * gbs
    reference = _mcore_steps(_mcore_ramp(gbs, mbs, dp, ramp, decrease), train_samples)
    assert len(reference) > 3
    for consumed, current, running, micro in reference:
        assert (ours.current_global_batch_size(consumed), ours.running_global_batch_size(consumed),
                ours.micro_batches(consumed)) == (current, running, micro), consumed
    # off the path of a run too (a resumed run may start anywhere)
    calculator = _mcore_ramp(gbs, mbs, dp, ramp, decrease)
    for consumed in range(0, ramp[2] + 2 * gbs, max(1, ramp[2] // 97)):
        calculator.update(consumed, consistency_check=False)
        assert ours.current_global_batch_size(consumed) == calculator.get_current_global_batch_size(), consumed
        assert ours.micro_batches(consumed) == calculator.get(), consumed
    for train_samples in (ramp[2] // 2, ramp[2], ramp[2] + 1, train_samples, train_samples + gbs - 1):
        expected = _mcore_train_iters(_mcore_ramp(gbs, mbs, dp, ramp, decrease), train_samples, gbs, ramp[2])
        assert ours.train_iters(train_samples) == expected, train_samples


def test_decrease_without_ramp_up_equals_megatron_core_constant_calculator():
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    for gbs, mbs, dp in ((7, 2, 1), (30, 2, 4), (16, 4, 2)):
        reference = ConstantNumMicroBatchesCalculator(gbs, mbs, dp, True, 1)
        ours = BatchSizeSchedule(global_batch_size=gbs, micro_batch_size=mbs, data_parallel_size=dp,
                                 decrease_if_needed=True)
        assert ours.micro_batches(123) == reference.get()
        assert ours.running_global_batch_size(5) == reference.get_current_running_global_batch_size()
        assert ours.train_iters(1000) == 1000 // gbs  # Megatron: train_samples // args.global_batch_size


def test_step_schedule_parses_megatron_thresholds():
    # '0:384 200B:768 400B:1152' with seq 4096: tokens → samples by floor division
    assert parse_step_schedule("0:384 200B:768 400B:1152", 4096) == [(0, 384), (48828125, 768), (97656250, 1152)]
    assert parse_step_schedule("0:16 2.4B:320, 12B:1536", 2048) == [(0, 16), (1171875, 320), (5859375, 1536)]
    assert parse_step_schedule("5K:8 0:4 1m:16", None) == [(0, 4), (5000, 8), (1000000, 16)]  # sorted, any case
    for bad in ("384", "100:8", "0:8 0:16", "0:8 x:16", "0:0", ""):
        with pytest.raises(ValueError):
            parse_step_schedule(bad, None)


def test_step_schedule_sizes_and_length():
    schedule = BatchSizeSchedule(global_batch_size=None, micro_batch_size=2, data_parallel_size=1,
                                 step_schedule="0:2 8:4 20:8")
    assert schedule.global_batch_size == 2  # Megatron's args.global_batch_size = mbs x dp
    sizes = {0: 2, 7: 2, 8: 4, 19: 4, 20: 8, 10**9: 8}
    assert {c: schedule.current_global_batch_size(c) for c in sizes} == sizes
    assert [schedule.micro_batches(c) for c in (0, 8, 20)] == [1, 2, 4]
    # steps at 0 2 4 6 | 8 12 16 | 20 28 36 (44 >= 40): Megatron-LM's update_train_iters counts 10
    assert schedule.train_iters(40) == 10
    assert schedule.train_iters(44) == 10 and schedule.train_iters(45) == 11
    tokens = BatchSizeSchedule(global_batch_size=None, micro_batch_size=1, data_parallel_size=4, seq_length=100,
                               step_schedule="0:4 1K:8")  # 1000 tokens = 10 samples
    assert [tokens.current_global_batch_size(c) for c in (8, 9, 10, 11)] == [4, 4, 8, 8]


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
        "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-3").split()


def _validated(extra, world=1):
    translation = translate_megatron(BASE + extra.split())
    config = Config(**{group: GROUPS[group](**values) for group, values in translation.fields.items()})
    return config_validation.validate(config, world).training


def _problems(extra, world=1):
    with pytest.raises(UsageError) as info:
        _validated(extra, world)
    return info.value.messages


def test_megatron_flags_map_to_the_native_fields():
    t = _validated("--global-batch-size 8 --rampup-batch-size 2 2 20 --train-samples 100")
    assert (t.rampup_batch_size, t.global_batch_size, t.gradient_accumulation_steps) == ([2, 2, 20], 8, 4)
    # the schedule as the words an unquoting launcher passes, or as one quoted word
    t = _validated("--step-batch-size-schedule 0:2 320:4 640:8 --train-samples 100")
    assert t.step_batch_size_schedule == "0:2 320:4 640:8" and t.global_batch_size is None
    translation = translate_megatron(BASE + ["--step-batch-size-schedule", "0:2 320:4", "--train-samples", "9"])
    assert translation.fields["training"]["step_batch_size_schedule"] == "0:2 320:4"
    t = _validated("--global-batch-size 7 --decrease-batch-size-if-needed --train-samples 70")
    assert t.decrease_batch_size_if_needed and t.gradient_accumulation_steps == 3


def test_megatron_rules_are_mirrored_with_one_line_each():
    assert _problems("--global-batch-size 8 --rampup-batch-size 2 2 20 --train-iters 10")[0].startswith(
        "training.rampup_batch_size: needs sample-based training")
    assert "shrinks the batch" in _problems("--step-batch-size-schedule 0:4 320:2 --train-samples 100")[0]
    assert "not a positive multiple of micro batch 2" in _problems(
        "--global-batch-size 8 --rampup-batch-size 3 1 20 --train-samples 100")[0]
    assert _validated("--global-batch-size 8 --rampup-batch-size 3 1 20 --train-samples 100 "
                      "--decrease-batch-size-if-needed").rampup_batch_size == [3, 1, 20]
    assert "in whole increments" in _problems("--global-batch-size 8 --rampup-batch-size 2 4 20 --train-samples 9")[0]
    assert "in whole increments" in _problems("--global-batch-size 8 --rampup-batch-size 8 4 20 --train-samples 9")[0]
    assert "must be positive" in _problems("--global-batch-size 8 --rampup-batch-size 2 2 0 --train-samples 9")[0]
    assert _problems("--global-batch-size 8 --rampup-batch-size 2 2 20 --train-samples 100 --lr-warmup-iters 3") == [
        "training.lr_warmup_iters: the run is counted in samples (train_samples) — use training.lr_warmup_samples "
        "(--lr-warmup-samples)"]
    assert "not divisible by micro batch 2 x data-parallel size 2" in _problems(
        "--step-batch-size-schedule 0:4 320:6 --train-samples 100", world=2)[0]
    with pytest.raises(UsageError) as info:  # Megatron-LM: "Cannot specify both ... and --global-batch-size"
        translate_megatron(BASE + "--global-batch-size 8 --step-batch-size-schedule 0:8 --train-samples 9".split())
    assert info.value.messages[0].startswith("--step-batch-size-schedule: Megatron-LM refuses it together with "
                                             "--global-batch-size")
    with pytest.raises(UsageError) as info:
        translate_megatron(BASE + "--step-batch-size-schedule 0:8 --train-iters 9".split())
    assert "sample-based training" in info.value.messages[0]
