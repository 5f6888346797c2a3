"""Where the run's scalars go besides the log line: TensorBoard and W&B together, plus the optional extras
Megatron writes there (memory, timers, params norm), and Megatron's progress.txt.

`ScalarWriters` fans `add_scalar(tag, value, step)` out to a TensorBoard `SummaryWriter` (training.tensorboard_dir)
and a `wandb_writer.WandbWriter` (training.wandb_project), each optional; tags are Megatron's (`lm loss`,
`learning-rate`, `grad-norm`, `mem-allocated-bytes`, `forward-backward-time`, ...).

`memory_scalars(device)`: Megatron's --log-memory-to-tensorboard scalars from the accelerator's allocator
(`torch.cuda.memory_stats` / `torch.npu.memory_stats`); on CPU, which has no allocator statistics, the process's
resident set size (`cpu_memory_bytes`, also the log line's memory figures) stands in for allocated / reserved
bytes and its peak for the max.

`IntervalTimers`: wall time of named phases summed between two log lines (Megatron's timers written with
--log-timers-to-tensorboard as `<name>-time`, seconds per iteration).

`ProgressLog`: Megatron's --log-progress file SAVE/progress.txt, one tab-separated line per event ("Starting job",
"Saved checkpoint" with the job's and the cumulative throughput), written by rank 0.

`params_l2_norm(model)`: Megatron's --log-params-norm, the global L2 norm of the parameters, reduced over their
shards exactly as the gradient norm is (`grad_clip.total_grad_norm`). Collective: every rank calls it.
"""
from __future__ import annotations

import os
import resource
import sys
import time
import types
from contextlib import contextmanager
from datetime import datetime
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch


def open_tensorboard(log_dir: Optional[str], print_fn: Callable[[str], None] = print):
    """A SummaryWriter for `log_dir`, or None (with a one-line notice when tensorboard is not installed)."""
    if not log_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print_fn(f"notice: tensorboard is not installed; no scalars are written to {log_dir} "
                 "(pip install tensorboard to get them)")
        return None
    return SummaryWriter(log_dir=log_dir, max_queue=1000)


class ScalarWriters:
    """TensorBoard and/or W&B behind one `add_scalar`; falsy when neither is open."""

    def __init__(self, writers: List[object]):
        self.writers = [w for w in writers if w is not None]

    def __bool__(self) -> bool:
        return bool(self.writers)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def cpu_memory_bytes() -> Tuple[int, int]:
    """(current, peak) resident set size of this process in bytes: current from psutil when it is installed,
    else /proc/self/statm (Linux); peak from getrusage (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        current = psutil.Process().memory_info().rss
    else:
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            current = peak  # no /proc: the peak is the best figure there is
    return current, max(peak, current)


def memory_scalars(device: torch.device) -> Dict[str, float]:
    """Megatron's memory scalars (bytes, and the allocator's live allocation count where there is one)."""
    if device.type == "cpu":
        current, peak = cpu_memory_bytes()
        return {"mem-reserved-bytes": current, "mem-allocated-bytes": current, "mem-max-allocated-bytes": peak}
    stats = getattr(torch, device.type).memory_stats(device)  # torch.cuda / torch.npu
    return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0)}


class IntervalTimers:
    """Named wall-clock timers summed over a log interval; `time(name)` is a context manager."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.totals: Dict[str, float] = {}
        self._started: Dict[str, float] = {}

    def start(self, name: str) -> None:
        self._sync()
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self._sync()
        started = self._started.pop(name, None)
        if started is not None:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - started

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def _sync(self) -> None:
        # accelerators run asynchronously: without a sync a phase's time would land in the next one
        if self.device is not None and self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize()

    def pop(self) -> Dict[str, float]:
        totals, self.totals = self.totals, {}
        return totals


def params_l2_norm(model: torch.nn.Module) -> float:
    """The global L2 norm of the model's parameters (sharded DTensors reduced like gradients). Collective."""
    from fsdp2_backend.training.grad_clip import total_grad_norm

    # total_grad_norm reads `.grad`: hand it each parameter in that role (one reduction code path, not two)
    as_grads = [types.SimpleNamespace(grad=p.detach()) for p in model.parameters()]
    return float(total_grad_norm(as_grads))


class ProgressLog:
    """Megatron's progress.txt in `save_dir` (rank 0 writes): date, job id, GPUs, event, tab-separated."""

    def __init__(self, save_dir: str, world_size: int, is_writer: bool, seq_length: int,
                 flops_per_iteration: Optional[float], start_iteration: int):
        self.path = os.path.join(save_dir, "progress.txt")
        self.world_size, self.is_writer, self.seq_length = world_size, is_writer, seq_length
        self.flops_per_iteration = flops_per_iteration or 0.0
        self.start_iteration, self.start_time = start_iteration, time.time()
        self._last_saved: Optional[int] = None

    def append(self, event: str) -> None:
        if not self.is_writer:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t"
                    f"# GPUs: {self.world_size}\t{event}\n")

    def start(self) -> None:
        self.append("Starting job")

    def _first_start(self) -> Tuple[Optional[datetime], float]:
        """(start time, FLOPs done then) of the earliest job of this world size since the last one of another
        size, as Megatron reads its progress.txt for the cumulative throughput."""
        start, start_flops, latest_flops = None, 0.0, 0.0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if len(fields) < 4:
                    continue
                size = int(fields[2].split(": ")[1])
                if fields[3] == "Saved checkpoint":
                    latest_flops = float(fields[7].split(": ")[1])
                if fields[3] == "Starting job":
                    if size != self.world_size:
                        start = None
                    elif start is None:
                        start, start_flops = datetime.strptime(fields[0], "%Y-%m-%d %H:%M:%S"), latest_flops
        return start, start_flops

    def saved_checkpoint(self, iteration: int, consumed_samples: int) -> None:
        """Megatron's line after a checkpoint save: job and cumulative TFLOP/s/GPU, FLOPs and tokens so far."""
        if not self.is_writer or iteration == self._last_saved:  # an interval save that is also the final one
            return
        self._last_saved = iteration
        flops_so_far = self.flops_per_iteration * iteration
        job_flops = self.flops_per_iteration * (iteration - self.start_iteration)
        job = job_flops / (max(time.time() - self.start_time, 1e-9) * 1e12 * self.world_size)
        start, start_flops = self._first_start()
        elapsed = (datetime.now() - start).total_seconds() if start else 0.0
        cumulative = (flops_so_far - start_flops) / (max(elapsed, 1.0) * 1e12 * self.world_size)
        self.append(f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                    f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                    f"Floating-point operations: {flops_so_far:.2e}\t"
                    f"Tokens (in billions): {consumed_samples * self.seq_length / 10**9:.2f}")
