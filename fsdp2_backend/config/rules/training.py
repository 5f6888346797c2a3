"""Rules of the `training.*` fields: the optimizer variants and the changing global batch. Torch-free; called once from
`validation`; its parts, in order:

Config rules of the optimizer variants: MindSpeed's O2 (`training.o2_optimizer`, training/o2_adamw.py) and
Muon's options (`training.muon_*`, training/muon.py). Torch-free; called once from `validation`.

Config rules of the changing global batch (`training.rampup_batch_size`, `step_batch_size_schedule`,
`decrease_batch_size_if_needed`), as Megatron-LM / megatron-core check them. Torch-free; called once from
`validation`. The arithmetic is `batch_schedule.py`'s.

Megatron's rules mirrored: ramp-up needs sample-based training (Megatron-LM 0.16: "expected no batch-size rampup for
iteration-based training"), a final size reachable from START in whole INCREMENTs, and every size it runs divisible
by micro batch x data-parallel size unless decrease_batch_size_if_needed; a step schedule refuses
--global-batch-size and --decrease-batch-size-if-needed and may not shrink the batch (Megatron stops at a decrease:
"Number of microbatches should be increasing"). Stricter here, with the reason: a step schedule needs
train_samples too (with --train-iters Megatron sizes the lr schedule and the data by train_iters x micro batch x dp,
which the growing batch overruns), and a ramp-up of 0 samples or with START = the final size is refused (megatron-core
divides by zero). Only the schedule's last size is checked here for divisibility (Megatron allows earlier entries a
resumed, rescaled run has passed); the trainer checks each step's size.
"""
from __future__ import annotations

from typing import List

from fsdp2_backend.config.batch_schedule import BatchSizeSchedule, parse_step_schedule
from fsdp2_backend.config.layout import parallel_layout


# --- optimizer -------------------------------------------------------------------------------------

def optimizer_errors(config) -> List[str]:
    """Every problem of the optimizer-variant fields."""
    t, p = config.training, config.parallel
    errors: List[str] = []
    if t.o2_optimizer and p.param_dtype != "bf16":
        errors.append(f"training.o2_optimizer: MindSpeed's O2 optimizer supports bf16 training only (parallel."
                      f"param_dtype is {p.param_dtype}) — train with --bf16, or drop --o2-optimizer")
    megatron_only = {"muon_nesterov": False, "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
                     "muon_extra_scale_factor": 1.0, "muon_fp32_matmul_prec": "medium"}
    if t.muon_scale_mode is None:
        errors += [f"training.{name}: an option of Megatron's Muon, which muon_scale_mode selects (unset: torch.optim."
                   f"Muon) — set training.muon_scale_mode (e.g. spectral), or drop {name}"
                   for name, default in megatron_only.items() if getattr(t, name) != default]
    if t.muon_num_ns_steps < 1:
        errors.append(f"training.muon_num_ns_steps: must be at least 1, got {t.muon_num_ns_steps}")
    return errors


# --- batch -----------------------------------------------------------------------------------------

_RAMP = "training.rampup_batch_size"
_STEPS = "training.step_batch_size_schedule"


def sample_based_errors(t) -> List[str]:
    """Megatron-LM's sample-based training rule: with train_samples, the lr schedule is counted in samples, and the
    iteration counts (which the schedule would not read) are refused ("expected sample-based ...")."""
    if not t.train_samples:
        return []
    return [f"training.{name}: the run is counted in samples (train_samples) — use "
            f"training.{name.replace('_iters', '_samples')} (--{name.replace('_', '-').replace('-iters', '-samples')})"
            for name in ("lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters") if getattr(t, name)]


def batch_schedule_errors(config, world_size: int) -> List[str]:
    """Every problem of the batch-size schedule fields and of sample-based training."""
    t = config.training
    ramp, steps = t.rampup_batch_size, t.step_batch_size_schedule
    errors: List[str] = sample_based_errors(t)
    if ramp is None and steps is None:
        return errors
    if ramp is not None and steps is not None:
        return [f"{_RAMP} / {_STEPS}: give one batch-size schedule (Megatron-LM replaced --rampup-batch-size by "
                f"--step-batch-size-schedule) — drop one"]
    flag = _RAMP if ramp is not None else _STEPS
    if not t.train_samples:
        errors.append(f"{flag}: needs sample-based training (Megatron refuses batch-size ramp-up with --train-iters) "
                      f"— give training.train_samples (--train-samples, with --lr-decay-samples / "
                      f"--lr-warmup-samples) instead of max_steps")
    mbs, dp = t.per_device_train_batch_size, parallel_layout(config.parallel, world_size).dp
    if mbs < 1 or dp < 1:
        return errors
    unit = mbs * dp
    if steps is not None:
        try:
            schedule = parse_step_schedule(steps, config.data.cutoff_len)
        except ValueError as exc:
            return errors + [f"{_STEPS}: {steps!r}: {exc} — write it as '0:GBS TOKENS:GBS ...' (e.g. '0:384 "
                             f"200B:768')"]
        if t.global_batch_size is not None:
            errors.append(f"{_STEPS}: Megatron refuses --global-batch-size with --step-batch-size-schedule (the "
                          f"schedule gives every size) — drop --global-batch-size (training.global_batch_size)")
        if t.decrease_batch_size_if_needed:
            errors.append(f"{_STEPS}: Megatron refuses --decrease-batch-size-if-needed with a step schedule — drop it")
        if t.gradient_accumulation_steps != 1:
            errors.append(f"{_STEPS}: the schedule sets the micro-batches of every step — drop "
                          f"training.gradient_accumulation_steps")
        sizes = [size for _, size in schedule]
        if any(after < before for before, after in zip(sizes, sizes[1:])):
            errors.append(f"{_STEPS}: {steps!r} shrinks the batch, which Megatron stops at (the micro-batches must "
                          f"increase) — give non-decreasing sizes")
        if sizes[-1] % unit:
            errors.append(f"{_STEPS}: the batch size {sizes[-1]} is not divisible by micro batch {mbs} x data-parallel "
                          f"size {dp} — change the schedule or --micro-batch-size")
        return errors
    if len(ramp) != 3:
        return errors + [f"{_RAMP}: {ramp} — give three numbers: START INCREMENT SAMPLES"]
    start, increment, samples = (int(v) for v in ramp)
    gbs = t.global_batch_size if t.global_batch_size is not None else mbs * t.gradient_accumulation_steps * dp
    if start <= 0 or increment <= 0 or samples <= 0:
        return errors + [f"{_RAMP}: {ramp}: START, INCREMENT and SAMPLES must be positive — e.g. 16 8 300000"]
    if gbs <= start or (gbs - start) % increment:
        return errors + [f"{_RAMP}: the global batch size {gbs} must exceed START {start} by a multiple of INCREMENT "
                         f"{increment} (Megatron's ramp-up reaches it in whole increments) — change "
                         f"--rampup-batch-size or --global-batch-size"]
    schedule = BatchSizeSchedule(global_batch_size=gbs, micro_batch_size=mbs, data_parallel_size=dp, rampup=ramp,
                                 decrease_if_needed=t.decrease_batch_size_if_needed)
    for consumed, _ in schedule.ramp_sizes(t.train_samples):
        problem = schedule.inconsistent(consumed)
        if problem:
            advice = ("" if t.decrease_batch_size_if_needed else ", or pass --decrease-batch-size-if-needed")
            return errors + [f"{_RAMP}: {problem} — choose sizes divisible by it{advice}"]
    return errors
