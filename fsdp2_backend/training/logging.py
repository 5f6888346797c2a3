"""Megatron's training and validation log lines (so existing log parsers keep working) and TensorBoard scalars.

Owns `format_train_line` / `format_validation_lines` (Megatron-LM training.py's `training_log` and
`evaluate_and_print_results` formats, field for field, with tokens/s per device and peak memory appended after
Megatron's last field), `MegatronLogLine` (a regex for the line, for tests and tools), `parse_train_line`,
and `TrainLogger`, which accumulates what Megatron accumulates between two log lines: losses of advanced
(non-skipped) iterations averaged over them, skipped and nan iteration counts, and the wall time per iteration.

Optional fields (off by default; the line is unchanged without them): Megatron's ` throughput per GPU
(TFLOP/s/GPU): X |` (MindSpeed `training.log_throughput`, Megatron `--log-throughput`) when the logger knows the
model FLOPs of one iteration, with ` model flops utilization (%): X.XX |` appended when the device's peak is
known too; and ` cpu memory (GiB): current X.XX, peak Y.YY |` (MindSpeed `training.log_cpu_memory`): this
process's resident set size now and its peak.

Megatron's monitoring extras (--log-params-norm, --tensorboard-log-interval, --log-memory-to-tensorboard,
--log-validation-ppl-to-tensorboard, --log-timers-to-tensorboard, --wandb-*, --log-progress) are TrainLogger
options; the writers behind them (TensorBoard + W&B, timers, memory, progress.txt) live in `metrics_writers`.
"""
from __future__ import annotations

import math
import re
import resource
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from fsdp2_backend.distributed.console import print_line
from fsdp2_backend.training.metrics_writers import (IntervalTimers, ScalarWriters, cpu_memory_bytes,  # noqa: F401
                                                     memory_scalars, open_tensorboard)

# One entry per loss key (` lm loss: 1.234567E+00 |`); Megatron prints the keys in the order they arrive.
MegatronLogLine = re.compile(
    r"^ \[(?P<timestamp>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{6})\]"
    r" iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|"
    r" consumed samples: +(?P<consumed_samples>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<elapsed_ms>\d+\.\d) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>\d+\.\d) \|)?"
    r" learning rate: (?P<learning_rate>\d\.\d{6}E[+-]\d{2}) \|"
    r" global batch size: +(?P<global_batch_size>\d+) \|"
    r"(?P<losses>(?: [^|:]+: -?\d\.\d{6}E[+-]\d{2} \|)*)"
    r" loss scale: (?P<loss_scale>\d+\.\d) \|"
    r"(?: grad norm: (?P<grad_norm>\d+\.\d{3}|nan|inf) \|)?"
    r"(?: num zeros: (?P<num_zeros>\d+) \|)?"
    r"(?: params norm: (?P<params_norm>\d+\.\d{3}) \|)?"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nan>\d+) \|"
    r"(?P<extra>.*)$")
_LOSS_ENTRY = re.compile(r" ([^|:]+): (-?\d\.\d{6}E[+-]\d{2}) \|")
# Our fields after Megatron's last one: (parse_train_line key(s), regex on the `extra` group).
_EXTRA_FIELDS = (
    (("tokens_per_sec_per_device",), re.compile(r" tokens per second per device: (\d+\.\d) \|")),
    (("peak_memory_gib",), re.compile(r" peak memory per device \(GiB\): (\d+\.\d{2}) \|")),
    (("mfu_percent",), re.compile(r" model flops utilization \(%\): (\d+\.\d{2}) \|")),
    (("cpu_memory_gib", "cpu_memory_peak_gib"),
     re.compile(r" cpu memory \(GiB\): current (\d+\.\d{2}), peak (\d+\.\d{2}) \|")),
)


def format_train_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                      learning_rate: float, global_batch_size: int, losses: Dict[str, float],
                      loss_scale: float = 1.0, grad_norm: Optional[float] = None,
                      skipped_iterations: int = 0, nan_iterations: int = 0,
                      tflops_per_device: Optional[float] = None, num_zeros: Optional[int] = None,
                      params_norm: Optional[float] = None, tokens_per_sec_per_device: Optional[float] = None,
                      peak_memory_gib: Optional[float] = None, mfu_percent: Optional[float] = None,
                      cpu_memory_gib: Optional[float] = None, cpu_memory_peak_gib: Optional[float] = None,
                      now: Optional[datetime] = None) -> str:
    """Megatron's training log line; `losses` are already averaged (e.g. {"lm loss": 2.5}).

    `tflops_per_device` is Megatron's `--log-throughput` field; ours after Megatron's last field, each only when
    given: tokens/s per device, peak memory per device, model FLOPs utilisation (%), and this process's CPU
    memory (`cpu_memory_gib` current and `cpu_memory_peak_gib` peak RSS, both needed)."""
    now = now or datetime.now()
    s = f" [{now.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " consumed samples: {:12d} |".format(consumed_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    if tflops_per_device is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_device:.1f} |"
    s += f" learning rate: {learning_rate:.6E} |"
    s += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        if value >= 0.0:  # Megatron drops negative averages (and nan, which compares false)
            s += " {}: {:.6E} |".format(key, value)
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        s += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += " number of skipped iterations: {:3d} |".format(skipped_iterations)
    s += " number of nan iterations: {:3d} |".format(nan_iterations)
    # Ours, after Megatron's last field so parsers that stop there keep working.
    if tokens_per_sec_per_device is not None:
        s += f" tokens per second per device: {tokens_per_sec_per_device:.1f} |"
    if peak_memory_gib is not None:
        s += f" peak memory per device (GiB): {peak_memory_gib:.2f} |"
    if mfu_percent is not None:
        s += f" model flops utilization (%): {mfu_percent:.2f} |"
    if cpu_memory_gib is not None and cpu_memory_peak_gib is not None:
        s += f" cpu memory (GiB): current {cpu_memory_gib:.2f}, peak {cpu_memory_peak_gib:.2f} |"
    return s


def parse_train_line(line: str) -> Optional[Dict[str, object]]:
    """The fields of a training log line (numbers as int/float, losses as a dict), or None if it is not one.

    Besides Megatron's fields (`tflops` is the throughput per GPU), our trailing fields are parsed from `extra`:
    tokens_per_sec_per_device, peak_memory_gib, mfu_percent, cpu_memory_gib, cpu_memory_peak_gib (None when the
    line does not have them)."""
    match = MegatronLogLine.match(line.rstrip("\n"))
    if match is None:
        return None
    out: Dict[str, object] = {}
    for key, value in match.groupdict().items():
        if value is None or key in ("timestamp", "losses", "extra"):
            out[key] = value
        elif key in ("iteration", "train_iters", "consumed_samples", "global_batch_size", "skipped", "nan",
                     "num_zeros"):
            out[key] = int(value)
        else:
            out[key] = float(value)
    out["losses"] = {k.strip(): float(v) for k, v in _LOSS_ENTRY.findall(match.group("losses"))}
    for keys, pattern in _EXTRA_FIELDS:
        found = pattern.search(match.group("extra"))
        for i, key in enumerate(keys):
            out[key] = float(found.group(i + 1)) if found else None
    return out


def format_validation_lines(iteration: int, losses: Dict[str, float], split: str = "") -> List[str]:
    """Megatron's validation block: a dash rule, the line (value and PPL per key, PPL capped at exp(20)),
    the rule again. `split` names the data set at the end of training ("validation set" / "test set")."""
    where = f"iteration {iteration}" + (f" on {split}" if split else "")
    s = f" validation loss at {where} | "
    for key, value in losses.items():
        s += "{} value: {:.6E} | ".format(key, value)
        s += "{} PPL: {:.6E} | ".format(key, math.exp(min(20.0, value)))
    rule = "-" * (len(s) + 1)
    return [rule, s, rule]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device`: the allocator's peak on accelerators, peak RSS on CPU."""
    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return getattr(torch, device.type).max_memory_allocated(device)  # torch.cuda / torch.npu


class TrainLogger:
    """Accumulates iterations and prints Megatron's line every `log_interval` iterations on the logging rank.

    All ranks call it (`params_norm_fn` is collective); only `is_logging_rank` (Megatron: the last rank) prints
    and writes TensorBoard / W&B. Values passed in must already be global (loss reduced over data-parallel
    ranks, global grad norm). `tokens_per_iteration` is the global batch's token count; tokens/s per device
    divides by `world_size`.

    `flops_per_iteration` (the model FLOPs of one global iteration, e.g. `throughput.model_flops_per_token(hf_config,
    seq_length) * tokens_per_iteration`) adds Megatron's `throughput per GPU (TFLOP/s/GPU)` = flops_per_iteration /
    time per iteration / world_size / 1e12, and model FLOPs utilisation against `peak_flops_per_device` (looked up
    from the device's name when not given; not shown when unknown, e.g. on CPU). `log_cpu_memory` adds this
    process's current and peak CPU memory (RSS).

    Megatron's extras: `params_norm_fn` (--log-params-norm: ` params norm:` in the line and `params-norm`),
    `tensorboard_log_interval` (scalars every N iterations), `log_memory` (--log-memory-to-tensorboard),
    `log_validation_ppl` (--log-validation-ppl-to-tensorboard), `log_timers` (--log-timers-to-tensorboard:
    `iteration-time`, `throughput` and the `timer(name)` phases as `<name>-time`), `wandb_options` (the
    `wandb_writer.open_wandb` arguments: the same scalars to W&B) and `progress_log` (--log-progress).
    """

    def __init__(self, *, train_iters: int, log_interval: int, global_batch_size: int, world_size: int,
                 device: torch.device, is_logging_rank: bool, tokens_per_iteration: int,
                 tensorboard_dir: Optional[str] = None, print_fn: Callable[[str], None] = print_line,
                 flops_per_iteration: Optional[float] = None, peak_flops_per_device: Optional[float] = None,
                 log_cpu_memory: bool = False, tensorboard_log_interval: int = 1,
                 params_norm_fn: Optional[Callable[[], float]] = None, log_memory: bool = False,
                 log_validation_ppl: bool = False, log_timers: bool = False,
                 wandb_options: Optional[Dict[str, Any]] = None, progress_log: Any = None):
        self.train_iters, self.log_interval = train_iters, max(1, log_interval)
        self.global_batch_size, self.world_size = global_batch_size, world_size
        self.device, self.is_logging_rank = device, is_logging_rank
        self.tokens_per_iteration = tokens_per_iteration
        self.flops_per_iteration, self.log_cpu_memory = flops_per_iteration, log_cpu_memory
        if flops_per_iteration is not None and peak_flops_per_device is None:
            from fsdp2_backend.training.throughput import peak_device_flops

            peak_flops_per_device = peak_device_flops(device)
        self.peak_flops_per_device = peak_flops_per_device
        self.print_fn = print_fn
        self.tensorboard_log_interval = max(1, tensorboard_log_interval)
        self.params_norm_fn, self.log_memory = params_norm_fn, log_memory
        self.log_validation_ppl, self.log_timers = log_validation_ppl, log_timers
        self.timers = IntervalTimers(device)
        self.writer = open_tensorboard(tensorboard_dir, print_fn) if is_logging_rank else None
        self.wandb = None
        if wandb_options and is_logging_rank:
            from fsdp2_backend.training.wandb_writer import open_wandb

            self.wandb = open_wandb(print_fn=print_fn, **wandb_options)
        self.writers = ScalarWriters([self.writer, self.wandb])
        # known on every rank alike (only the logging rank opens writers): decides the collective params norm
        self._scalars_configured = bool(tensorboard_dir or wandb_options)
        self.progress_log = progress_log
        if progress_log is not None:
            progress_log.start()
        self._consumed_samples: Optional[int] = None
        self._reset()
        self._interval_start = time.perf_counter()

    def _reset(self) -> None:
        self.loss_sums: Dict[str, float] = {}
        self.advanced = self.skipped = self.nan = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Excludes the block's time (validation, checkpoint saving) from the time per iteration, as Megatron
        stops its interval timer around them."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._interval_start += time.perf_counter() - start

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """A batch-size ramp-up changed the global batch: the line's `global batch size`, tokens/s and FLOPs follow
        it from the next record on (Megatron prints the current size)."""
        if global_batch_size != self.global_batch_size:
            scale = global_batch_size / self.global_batch_size
            self.tokens_per_iteration = int(round(self.tokens_per_iteration * scale))
            if self.flops_per_iteration is not None:
                self.flops_per_iteration *= scale
            self.global_batch_size = global_batch_size

    def timer(self, name: str):
        """Times a phase of the iteration (e.g. "forward-backward", "optimizer") for --log-timers-to-tensorboard;
        a no-op (no device synchronisation) without it."""
        return self.timers.time(name) if self.log_timers else nullcontext()

    def start_timer(self, name: str) -> None:
        """`timer` as two calls, for a phase that is not one block."""
        if self.log_timers:
            self.timers.start(name)

    def stop_timer(self, name: str) -> None:
        if self.log_timers:
            self.timers.stop(name)

    def record(self, iteration: int, *, losses: Dict[str, float], skipped: bool, learning_rate: float,
               grad_norm: Optional[float], consumed_samples: int, loss_scale: float = 1.0,
               got_nan: Optional[bool] = None) -> Optional[str]:
        """Adds one iteration; returns (and prints, on the logging rank) the line when one is due. `got_nan`: the
        trainer's verdict (a NaN gradient counts too); None: a skipped iteration whose loss is not finite."""
        self._consumed_samples = consumed_samples
        if skipped:
            self.skipped += 1
            # Megatron counts a skipped iteration as a nan iteration when its loss is not finite.
            self.nan += int(any(not math.isfinite(v) for v in losses.values()) if got_nan is None else got_nan)
        else:
            self.advanced += 1
            for key, value in losses.items():
                self.loss_sums[key] = self.loss_sums.get(key, 0.0) + value
        line_due = iteration % self.log_interval == 0
        scalars_due = iteration % self.tensorboard_log_interval == 0
        # every rank takes part in the norm's reduction, on iterations every rank knows to be due
        params_norm = (self.params_norm_fn() if self.params_norm_fn is not None and
                       (line_due or (scalars_due and self._scalars_configured)) else None)
        if self.writers and scalars_due:
            self._write_scalars(iteration, losses, learning_rate, grad_norm, consumed_samples, loss_scale,
                                params_norm)
        if not line_due:
            return None
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize()
        now = time.perf_counter()
        iterations = self.advanced + self.skipped
        elapsed = (now - self._interval_start) / max(iterations, 1)
        tflops = mfu = cpu_now = cpu_peak = None
        if self.flops_per_iteration is not None:
            flops_per_sec_per_device = self.flops_per_iteration / elapsed / self.world_size if elapsed else 0.0
            tflops = flops_per_sec_per_device / 1e12
            if self.peak_flops_per_device:
                mfu = 100.0 * flops_per_sec_per_device / self.peak_flops_per_device
        if self.log_cpu_memory:
            cpu_now, cpu_peak = (value / 2**30 for value in cpu_memory_bytes())
        line = format_train_line(
            iteration=iteration, train_iters=self.train_iters, consumed_samples=consumed_samples,
            elapsed_ms=elapsed * 1000.0, learning_rate=learning_rate, global_batch_size=self.global_batch_size,
            losses={k: v / max(1, self.advanced) for k, v in self.loss_sums.items()}, loss_scale=loss_scale,
            grad_norm=grad_norm, skipped_iterations=self.skipped, nan_iterations=self.nan,
            params_norm=params_norm,
            tokens_per_sec_per_device=self.tokens_per_iteration / elapsed / self.world_size if elapsed else 0.0,
            peak_memory_gib=peak_memory_bytes(self.device) / 2**30, tflops_per_device=tflops, mfu_percent=mfu,
            cpu_memory_gib=cpu_now, cpu_memory_peak_gib=cpu_peak)
        if self.writers and self.log_timers:  # Megatron writes these at the log interval, with its timers
            self.writers.add_scalar("iteration-time", elapsed, iteration)
            if tflops is not None:
                self.writers.add_scalar("throughput", tflops, iteration)
            for name, total in self.timers.pop().items():
                self.writers.add_scalar(f"{name}-time", total / max(iterations, 1), iteration)
        self.timers.pop()
        if self.is_logging_rank:
            self.print_fn(line)
        self._reset()
        self._interval_start = now
        return line

    def validation(self, iteration: int, losses: Dict[str, float], consumed_samples: int,
                   split: str = "") -> List[str]:
        """Prints Megatron's validation block (logging rank) and writes its scalars. Their "vs samples" x is
        the consumed training samples, as Megatron's (`consumed_samples` only before any iteration is recorded)."""
        lines = format_validation_lines(iteration, losses, split)
        if self.is_logging_rank:
            for line in lines:
                self.print_fn(line)
        samples = self._consumed_samples if self._consumed_samples is not None else consumed_samples
        if self.writers:
            for key, value in losses.items():
                self.writers.add_scalar(f"{key} validation", value, iteration)
                self.writers.add_scalar(f"{key} validation vs samples", value, samples)
                if self.log_validation_ppl:
                    ppl = math.exp(min(20.0, value))
                    self.writers.add_scalar(f"{key} validation ppl", ppl, iteration)
                    self.writers.add_scalar(f"{key} validation ppl vs samples", ppl, samples)
        return lines

    def checkpoint_saved(self, iteration: int) -> None:
        """After a checkpoint save: Megatron's progress.txt line (--log-progress)."""
        if self.progress_log is not None:
            self.progress_log.saved_checkpoint(iteration, self._consumed_samples or 0)

    def _write_scalars(self, iteration, losses, learning_rate, grad_norm, consumed_samples, loss_scale,
                       params_norm) -> None:
        # Megatron's scalar names (training.py training_log), every tensorboard_log_interval iterations.
        w = self.writers
        if self.wandb is not None:
            self.wandb.add_scalar("samples vs steps", consumed_samples, iteration)
        w.add_scalar("learning-rate", learning_rate, iteration)
        w.add_scalar("learning-rate vs samples", learning_rate, consumed_samples)
        w.add_scalar("batch-size", self.global_batch_size, iteration)
        w.add_scalar("batch-size vs samples", self.global_batch_size, consumed_samples)
        for key, value in losses.items():
            w.add_scalar(key, value, iteration)
            w.add_scalar(f"{key} vs samples", value, consumed_samples)
        w.add_scalar("loss-scale", loss_scale, iteration)
        w.add_scalar("loss-scale vs samples", loss_scale, consumed_samples)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, iteration)
            w.add_scalar("grad-norm vs samples", grad_norm, consumed_samples)
        if params_norm is not None:
            w.add_scalar("params-norm", params_norm, iteration)
            w.add_scalar("params-norm vs samples", params_norm, consumed_samples)
        if self.log_memory:
            for tag, value in memory_scalars(self.device).items():
                w.add_scalar(tag, value, iteration)

    def close(self) -> None:
        self.writers.close()
