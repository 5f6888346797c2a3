"""StepProfiler: a 2-rank gloo run of a tiny loop writes a Chrome trace for the chosen steps on the chosen rank
only; bad settings are refused before training."""
import json
import os

import pytest
import torch

from fsdp2_backend.config import ProfilingArguments
from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.training.profiler import StepProfiler
from tests.support.launchers import run_distributed


def _tiny_loop(profiler, iterations, first=0):
    import torch.distributed as dist

    w = torch.randn(16, 16, requires_grad=True)
    for it in range(first + 1, first + iterations + 1):
        with torch.profiler.record_function(f"train_iteration_{it}"):
            loss = (torch.randn(4, 16) @ w).pow(2).sum()
            loss.backward()
            if dist.is_initialized():
                dist.all_reduce(w.grad)
        profiler.step(it)
    profiler.close()


def _worker(rank, world, save_path):
    args = ProfilingArguments(profile=True, profile_step_start=1, profile_step_end=3, profile_ranks=[1],
                              profile_save_path=save_path, profile_record_shapes=True)
    _tiny_loop(StepProfiler(args, rank=rank, device_type="cpu", print_fn=lambda _s: None), 5)


def _events(path):
    with open(path) as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_two_ranks_profile_only_the_chosen_steps_and_rank(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["rank1_steps1-2.pt.trace.json", "rank1_steps1-2.table.txt"]
    names = _events(tmp_path / "rank1_steps1-2.pt.trace.json")
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#0" not in names
    # step i is iteration i+1: iterations 2 and 3 are inside, 1 and 4 are not
    assert {"train_iteration_2", "train_iteration_3"} <= names
    assert not names & {"train_iteration_1", "train_iteration_4", "train_iteration_5"}
    assert "aten::mm" in (tmp_path / "rank1_steps1-2.table.txt").read_text()


def test_to_the_end_from_a_resumed_iteration(tmp_path):
    args = ProfilingArguments(profile=True, profile_step_start=10, profile_step_end=-1, profile_ranks=[-1],
                              profile_save_path=str(tmp_path))
    profiler = StepProfiler(args, rank=0, device_type="cpu", first_iteration=10, print_fn=lambda _s: None)
    assert profiler.active  # the window opens at once when the run resumes at its start
    _tiny_loop(profiler, 3, first=10)
    names = _events(tmp_path / "rank0_steps10-12.pt.trace.json")
    assert {"train_iteration_11", "train_iteration_13"} <= names


def test_resumed_inside_the_window_profiles_its_rest(tmp_path):
    args = ProfilingArguments(profile=True, profile_step_start=2, profile_step_end=5, profile_save_path=str(tmp_path))
    _tiny_loop(StepProfiler(args, rank=0, device_type="cpu", first_iteration=3, print_fn=lambda _s: None), 4, first=3)
    assert sorted(os.listdir(tmp_path)) == ["rank0_steps3-4.pt.trace.json", "rank0_steps3-4.table.txt"]


def test_disabled_or_other_rank_writes_nothing(tmp_path):
    for args in (ProfilingArguments(profile=False, profile_save_path=str(tmp_path)),
                 ProfilingArguments(profile=True, profile_ranks=[3], profile_save_path=str(tmp_path))):
        _tiny_loop(StepProfiler(args, rank=0, device_type="cpu"), 2)
    assert os.listdir(tmp_path) == []


def test_bad_settings_are_usage_errors(tmp_path):
    """Validation refuses them, before any process group (db export needs torch_npu, absent here)."""
    from fsdp2_backend.config import Config
    from fsdp2_backend.config.validation import validate

    config = Config()
    config.profiling = ProfilingArguments(profile=True, profile_export_type="db", profile_step_start=4,
                                          profile_step_end=2, profile_save_path=str(tmp_path))
    with pytest.raises(UsageError) as err:
        validate(config)
    text = "\n".join(err.value.messages)
    assert "profiling.profile_export_type" in text and "profiling.profile_step_end" in text