"""Faults between processes, with real processes: the save directory's lock (a second run refused while the first
lives, taken over once it was killed), Megatron's --exit-signal-handler under torchrun (SIGTERM sent to the whole
process tree, as a scheduler's preemption does: the workers save at the next iteration and exit, and the same
command resumes from there), and a usage error under torchrun printed once."""
from __future__ import annotations

import re
import signal
import socket

from tests.support.megatron_lines import FAULT_RUN_FLAGS
from tests.support.launchers import run_entry, signal_tree, start_entry, wait_for_log


def test_a_second_run_into_a_live_runs_save_dir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
    save = tmp_path / "save"
    first = start_entry(FAULT_RUN_FLAGS + ["--train-iters", "100000", "--save", save], tmp_path / "first.log")
    try:
        wait_for_log(first, tmp_path / "first.log", r"iteration +2/")
        second = run_entry(FAULT_RUN_FLAGS + ["--train-iters", "4", "--save", save])
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in second.stderr
        assert re.fullmatch(re.escape(f"error: training.output_dir (--save): {save} is in use by another run (pid "
                                      f"{first.pid} on host {socket.gethostname()}, started ")
                            + r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
                            + re.escape(") — give this run its own --save directory, or wait for that run to end"),
                            errors[0]), errors[0]
        assert first.poll() is None  # the live run goes on
    finally:
        signal_tree(first.pid, signal.SIGKILL)
        first.wait()
    third = run_entry(FAULT_RUN_FLAGS + ["--train-iters", "4", "--save", save])
    assert third.returncode == 0, third.stderr[-3000:]
    assert re.search(re.escape(f"notice: training.output_dir (--save): removed the stale lock of an earlier run "
                               f"(pid {first.pid} on host {socket.gethostname()}, started ") + r"[^;]+; no longer "
                     r"running\)", third.stdout + third.stderr)
    assert not (save / ".fsdp2_run.lock").exists()  # released at the end


def test_sigterm_to_the_whole_torchrun_tree_saves_at_the_next_iteration_and_exits(tmp_path):
    from fsdp2_backend.checkpoint import dirs

    save, log = tmp_path / "save", tmp_path / "run.log"
    args = FAULT_RUN_FLAGS + ["--train-iters", "100000", "--save", save, "--exit-signal-handler"]
    launcher = start_entry(args, log, ranks=2)
    try:
        seen = int(wait_for_log(launcher, log, r"iteration +(\d+)/").group(1))
        signal_tree(launcher.pid, signal.SIGTERM)  # the launcher and both workers, as SLURM's preemption does
        launcher.wait(timeout=120)
    finally:
        signal_tree(launcher.pid, signal.SIGKILL)
    text = log.read_text()
    saved = int(re.search(r"exiting program after receiving SIGTERM \(checkpoint of iteration (\d+) saved\)\.",
                          text).group(1))
    assert saved >= seen
    assert [i for i, _ in dirs.complete_checkpoints(save)] == [saved] and dirs.read_latest_marker(save) == saved
    printed = [int(i) for i in re.findall(r" iteration +(\d+)/", text)]
    assert max(printed) == saved  # no iteration after the saved one ran
    assert not (save / ".fsdp2_run.lock").exists()
    # the same command (with a length that ends soon) resumes from that checkpoint
    resumed = run_entry(FAULT_RUN_FLAGS + ["--train-iters", saved + 2, "--save", save, "--exit-signal-handler",
                           "--override-opt_param-scheduler"])  # a shorter run: its own schedule length
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [int(i) for i in re.findall(r" iteration +(\d+)/", resumed.stdout)] == [saved + 1, saved + 2]


def test_a_usage_error_under_torchrun_is_printed_once(tmp_path):
    result = run_entry(FAULT_RUN_FLAGS + ["--train-iters", "4", "--lr", "-1", "--save", tmp_path / "save"], ranks=2)
    assert result.returncode != 0
    line = "error: training.lr: must be >= 0, got -1.0 (Megatron --lr) — give the peak learning rate"
    assert result.stderr.count(line) == 1 and (result.stdout + result.stderr).count("error: ") == 1
    assert not re.search(r"^\[rank\d\]:", result.stderr, re.MULTILINE)  # no worker traceback
