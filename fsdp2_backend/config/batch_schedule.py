"""Megatron's changing global batch: ramp-up (--rampup-batch-size), step schedules (--step-batch-size-schedule) and
--decrease-batch-size-if-needed, as functions of the consumed samples.

Owns `BatchSizeSchedule` (what megatron-core's num-microbatches calculators compute: the global batch size, the
batch actually run and the micro-batches per step at a number of consumed samples; the training length in
iterations as Megatron-LM's `update_train_iters` counts it) and `parse_step_schedule`.

Semantics, from megatron-core 0.16.1 (`RampupBatchsizeNumMicroBatchesCalculator`,
`ConstantNumMicroBatchesCalculator`) and, for the step schedule (absent from 0.16.1), Megatron-LM's current
`StepBatchsizeNumMicroBatchesCalculator`:
- ramp-up `START INCREMENT SAMPLES` towards the global batch size G: with n = (G - START) / INCREMENT increments of
  SAMPLES / n samples each (a float), a step at c consumed samples runs START + int(c / (SAMPLES / n)) x
  INCREMENT, and G once c > SAMPLES;
- step schedule `"T0:B0 T1:B1 ..."` (thresholds with K/M/B/T suffixes, as tokens converted to samples by
  // seq_length, since Megatron always passes the GPT sequence length): the batch of the last threshold <= c;
- decrease-batch-size-if-needed: the batch run is rounded down to a multiple of micro batch x data-parallel size;
  Megatron counts the training length with the unrounded size but consumes (and advances the lr schedule by)
  the rounded one.
The trainer reads `running_global_batch_size(consumed)` / `micro_batches(consumed)` before every step, so a resumed
run (consumed samples restored) continues mid-ramp exactly. Written here, not imported: megatron-core is a
test-only reference (tests compare the two). Torch-free, so config validation uses it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

_SUFFIXES = {"T": 1_000_000_000_000, "B": 1_000_000_000, "M": 1_000_000, "K": 1_000}


def _number(text: str) -> int:
    """Megatron's `_parse_numeric_value`: '2.4B' → 2400000000 (int(float(x) x multiplier))."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    if multiplier != 1:
        text = text[:-1]
    return int(float(text) * multiplier)


def parse_step_schedule(text: str, seq_length: Optional[int]) -> List[Tuple[int, int]]:
    """'0:384 200B:768' → [(threshold in samples, batch size)], sorted; thresholds are tokens when seq_length is
    given (divided by it, as Megatron does). Raises ValueError with what is wrong, Megatron's checks included."""
    schedule = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold_text, size_text = entry.split(":", 1)
        try:
            threshold, size = _number(threshold_text), _number(size_text)
        except ValueError:
            raise ValueError(f"entry {entry!r}: not a number (suffixes K, M, B, T)") from None
        schedule.append((threshold // seq_length if seq_length else threshold, size))
    schedule.sort(key=lambda item: item[0])
    if not schedule:
        raise ValueError("no entry")
    if schedule[0][0] != 0:
        raise ValueError(f"the first threshold must be 0, got {schedule[0][0]} samples")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"thresholds must increase strictly (in samples: {before} then {after})")
    if any(size <= 0 for _, size in schedule):
        raise ValueError("batch sizes must be positive")
    return schedule


class BatchSizeSchedule:
    """The global batch of every step, from the samples consumed before it.

    `global_batch_size` is Megatron's `args.global_batch_size`: the size after the ramp-up (ramp-up, constant), or
    micro batch x dp when a step schedule gives the sizes (Megatron then forbids --global-batch-size); the lr
    schedule of iteration-based runs, evaluation and the data's sample counts use it, as in Megatron.
    """

    def __init__(self, *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: Optional[Sequence[int]] = None, step_schedule: Optional[str] = None,
                 seq_length: Optional[int] = None, decrease_if_needed: bool = False):
        self.micro_batch_size, self.data_parallel_size = micro_batch_size, data_parallel_size
        self.unit = micro_batch_size * data_parallel_size
        self.decrease_if_needed = decrease_if_needed
        self.rampup = tuple(int(v) for v in rampup) if rampup is not None else None
        self.steps = parse_step_schedule(step_schedule, seq_length) if step_schedule is not None else None
        self.global_batch_size = self.unit if self.steps is not None else global_batch_size
        if self.rampup is not None:
            start, increment, _ = self.rampup
            self._per_increment = self.rampup[2] / ((global_batch_size - start) // increment)

    @property
    def changes(self) -> bool:
        """Whether the batch size can change between steps (ramp-up or step schedule)."""
        return self.rampup is not None or self.steps is not None

    def current_global_batch_size(self, consumed: int) -> int:
        """Megatron's `get_current_global_batch_size()` after `update_num_microbatches(consumed)`."""
        if self.steps is not None:
            size = self.steps[0][1]
            for threshold, value in self.steps:
                if consumed < threshold:
                    break
                size = value
            return size
        if self.rampup is not None:
            start, increment, samples = self.rampup
            if consumed > samples:
                return self.global_batch_size
            return start + int(consumed / self._per_increment) * increment
        return self.global_batch_size

    def running_global_batch_size(self, consumed: int) -> int:
        """The batch the step at `consumed` runs and consumes (rounded down under decrease_if_needed)."""
        size = self.current_global_batch_size(consumed)
        return size // self.unit * self.unit if self.decrease_if_needed else size

    def micro_batches(self, consumed: int) -> int:
        """Micro-batches (gradient accumulation) of the step at `consumed`."""
        return self.running_global_batch_size(consumed) // self.unit

    def inconsistent(self, consumed: int) -> Optional[str]:
        """Megatron's consistency check of the step at `consumed`: None, or what is wrong."""
        size = self.running_global_batch_size(consumed)
        if size % self.unit == 0 and size >= self.unit:
            return None
        return (f"the global batch size {size} (at {consumed} consumed samples) is not a positive multiple of micro "
                f"batch {self.micro_batch_size} x data-parallel size {self.data_parallel_size}")

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a run of `train_samples` samples, as Megatron-LM's `update_train_iters` counts them:
        ramp-up (0.16): the steps while consumed <= ramp-up samples (and <= train_samples), then the whole global
        batches left; step schedule: steps until train_samples is reached; else train_samples // gbs. The counted
        sizes are the unrounded ones, as in Megatron."""
        if self.steps is not None:
            iterations = consumed = 0
            while consumed < train_samples:
                consumed += self.current_global_batch_size(consumed)
                iterations += 1
            return iterations
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.current_global_batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def ramp_sizes(self, train_samples: Optional[int] = None) -> List[Tuple[int, int]]:
        """[(consumed samples, running batch)] of a fresh run's steps until the size stops changing (end of the
        ramp, or the last step-schedule threshold), capped at train_samples; for validation."""
        if not self.changes:
            return [(0, self.running_global_batch_size(0))]
        end = self.rampup[2] if self.rampup is not None else self.steps[-1][0]
        if train_samples is not None:
            end = min(end, train_samples)
        sizes, consumed = [], 0
        while True:
            size = self.running_global_batch_size(consumed)
            sizes.append((consumed, size))
            if consumed > end or size <= 0:
                return sizes
            consumed += size


def schedule_for(config, data_parallel_size: int) -> Optional[BatchSizeSchedule]:
    """The run's schedule from a validated Config (None when the batch is fixed and needs no rounding)."""
    t = config.training
    if t.rampup_batch_size is None and t.step_batch_size_schedule is None and not t.decrease_batch_size_if_needed:
        return None
    mbs = t.per_device_train_batch_size
    gbs = t.global_batch_size if t.global_batch_size is not None else (
        mbs * t.gradient_accumulation_steps * data_parallel_size)
    return BatchSizeSchedule(global_batch_size=gbs, micro_batch_size=mbs, data_parallel_size=data_parallel_size,
                             rampup=t.rampup_batch_size, step_schedule=t.step_batch_size_schedule,
                             seq_length=config.data.cutoff_len, decrease_if_needed=t.decrease_batch_size_if_needed)
