"""Step-window profiling (the seed's profiling group): torch.profiler on CPU / CUDA, torch_npu.profiler on Ascend.

Owns `StepProfiler`. Steps are counted like Megatron's `--profile-step-start/-end`: the step with 0-based index
i is the (i+1)-th iteration of the run's global count (so a resumed run keeps its numbering); the window is
[profile_step_start, profile_step_end), profile_step_end -1 = to the end of training (a run resumed inside
the window profiles the rest of it; Megatron would skip it). Only ranks in
`profile_ranks` ([-1] = all) profile; the others do nothing.

Output, under `profile_save_path`:
- CPU / CUDA (torch.profiler): `rank{R}_steps{A}-{B}.pt.trace.json` (Chrome trace: open in chrome://tracing or
  https://ui.perfetto.dev; steps appear as `ProfilerStep#i`) and `rank{R}_steps{A}-{B}.table.txt` (op table).
  torch.profiler has no levels: level_none / level0 record the defaults, level1 adds module hierarchy,
  level2 also FLOPs. `profile_export_type: db` and `profile_data_simplification` are Ascend features and are
  refused by validation (see `_check`).
- NPU (torch_npu.profiler, written to its documented API, untested here): levels map to
  `ProfilerLevel.Level_none/Level0/Level1/Level2`, export type to `ExportType.Text/Db`, data simplification to
  `_ExperimentalConfig(data_simplification=...)`; results go through `tensorboard_trace_handler(save_path)`
  (its `*_ascend_pt/ASCEND_PROFILER_OUTPUT` layout, openable in MindStudio Insight).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from fsdp2_backend.kernels.npu import torch_npu_module

_TORCH_LEVEL_OPTIONS = {"level_none": {}, "level0": {}, "level1": {"with_modules": True},
                        "level2": {"with_modules": True, "with_flops": True}}
_NPU_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


class StepProfiler:
    """Call `step(iteration)` after every completed iteration (Megatron's 1-based count) and `close()` at the
    end. `profiling` is a ProfilingArguments (or anything with its field names); `first_iteration` is the
    iteration the run starts from (0, or the resumed checkpoint's)."""

    def __init__(self, profiling: Any, *, rank: int, device_type: str, first_iteration: int = 0,
                 print_fn: Callable[[str], None] = print):
        self.args, self.rank, self.device_type = profiling, rank, device_type
        self.print_fn = print_fn
        self.start_step = profiling.profile_step_start
        self.end_step = profiling.profile_step_end  # exclusive; -1: to the end
        ranks = list(profiling.profile_ranks)
        self.enabled = bool(profiling.profile) and (-1 in ranks or rank in ranks)
        self._prof = None
        self._first = self._last_done = self.start_step  # first recorded / last completed step of the window
        if not profiling.profile:
            return
        _check(profiling, device_type)
        if self.enabled and self._in_window(first_iteration):  # a run resumed inside the window profiles the rest
            self._start(first_iteration)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step(self, iteration: int) -> None:
        """Marks the end of 0-based step `iteration - 1`; starts or stops the window as it comes due."""
        if not self.enabled:
            return
        if self._prof is not None:
            self._last_done = iteration - 1
            if self.end_step != -1 and iteration >= self.end_step:
                self._stop()
            else:
                self._prof.step()
        elif self._in_window(iteration):
            self._start(iteration)

    def close(self) -> None:
        """Stops and writes an open window (profile_step_end -1, or training ended inside the window)."""
        if self._prof is not None:
            self._stop()

    def _in_window(self, step: int) -> bool:
        return self.start_step <= step and (self.end_step == -1 or step < self.end_step)

    def _start(self, step: int) -> None:
        self._first = self._last_done = step
        os.makedirs(self.args.profile_save_path, exist_ok=True)
        if self.device_type == "npu":
            self._prof = _npu_profiler(self.args)
        else:
            self._prof = self._torch_profiler()
            self._prof.step_num = step  # step markers carry the training step index
        self._prof.start()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()  # fires on_trace_ready: the files are written here

    def _torch_profiler(self):
        a = self.args
        activities = [torch.profiler.ProfilerActivity.CPU] if a.profile_with_cpu or self.device_type == "cpu" else []
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities, record_shapes=a.profile_record_shapes, profile_memory=a.profile_with_memory,
            with_stack=a.profile_with_stack, on_trace_ready=self._write_torch_trace,
            schedule=lambda _step: torch.profiler.ProfilerAction.RECORD,  # always on; a schedule adds step marks
            **_TORCH_LEVEL_OPTIONS[a.profile_level])

    def _write_torch_trace(self, prof) -> None:
        last = self._last_done
        stem = os.path.join(self.args.profile_save_path, f"rank{self.rank}_steps{self._first}-{last}")
        prof.export_chrome_trace(stem + ".pt.trace.json")
        sort_key = "self_cuda_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
        with open(stem + ".table.txt", "w", encoding="utf-8") as f:
            f.write(prof.key_averages(group_by_input_shape=self.args.profile_record_shapes)
                    .table(sort_by=sort_key, row_limit=50))
        self.print_fn(f"profile: rank {self.rank} wrote {stem}.pt.trace.json (steps {self._first}..{last})")


def _check(profiling: Any, device_type: str) -> None:
    """What validation established (`fsdp2_backend.config.validation`), asserted for this device."""
    assert profiling.profile_step_start >= 0 and (profiling.profile_step_end == -1
                                                  or profiling.profile_step_end > profiling.profile_step_start)
    assert device_type == "npu" or profiling.profile_export_type != "db", "db export needs torch_npu"


def _npu_profiler(a: Any):
    """torch_npu.profiler.profile configured from the seed's fields (Ascend only)."""
    if torch_npu_module() is None:  # the one NPU probe; torch_npu is never imported before it said yes
        raise RuntimeError("profiler: this run is on npu but torch_npu does not import or sees no NPU")
    from torch_npu import profiler as npu_prof

    config = npu_prof._ExperimentalConfig(
        profiler_level=getattr(npu_prof.ProfilerLevel, _NPU_LEVELS[a.profile_level]),
        export_type=npu_prof.ExportType.Db if a.profile_export_type == "db" else npu_prof.ExportType.Text,
        data_simplification=a.profile_data_simplification)
    activities = [npu_prof.ProfilerActivity.NPU]
    if a.profile_with_cpu:
        activities.insert(0, npu_prof.ProfilerActivity.CPU)
    return npu_prof.profile(
        activities=activities, record_shapes=a.profile_record_shapes, profile_memory=a.profile_with_memory,
        with_stack=a.profile_with_stack, experimental_config=config,
        # Always recording once started (the window is opened and closed by StepProfiler); a schedule makes
        # torch_npu mark steps.
        schedule=npu_prof.schedule(wait=0, warmup=0, active=1_000_000_000, repeat=1),
        on_trace_ready=npu_prof.tensorboard_trace_handler(a.profile_save_path))
