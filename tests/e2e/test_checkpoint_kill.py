"""SIGKILL of a job that saves every step: a restart of the same command always resumes from the newest
complete checkpoint (the one the latest marker names; the one before when the kill fell between rename and
marker), never a partial one, and ends exactly where an uninterrupted run ends.

The job (`tests/support/checkpoint_kill_job.train_loop`, run as a separate python process) is a 1-rank FSDP2
Qwen3 with attention dropout (so RNG restore matters) saving every step with rotation. It is killed mid-write (a `.tmp` directory
exists), right after a commit (the rename just happened, the marker may lag), and at a random moment.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.support.checkpoint_kill_job import TOTAL_STEPS

REPO = Path(__file__).resolve().parents[2]


def _start(save_dir: Path) -> subprocess.Popen:
    code = f"from tests.support.checkpoint_kill_job import train_loop; train_loop({str(save_dir)!r})"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _wait_until(proc: subprocess.Popen, condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the job ended before the moment we meant to kill it"
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.002)


def _kill(proc: subprocess.Popen) -> str:
    assert proc.poll() is None, "the job ended before the kill"
    proc.send_signal(signal.SIGKILL)
    return proc.communicate()[0]


def test_sigkill_while_saving_resumes_from_newest_complete(tmp_path):
    from fsdp2_backend.checkpoint import dirs

    reference_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    reference = _start(reference_dir)

    def newest() -> int:
        found = dirs.complete_checkpoints(killed_dir)
        return found[-1][0] if found else 0

    def expected_resume() -> int:
        # The spec: the marker's checkpoint when complete, else the highest complete one.
        marker = dirs.read_latest_marker(killed_dir)
        complete = [i for i, _ in dirs.complete_checkpoints(killed_dir)]
        assert complete and (marker is None or marker in complete or marker < complete[-1])
        return marker if marker in complete else complete[-1]

    def writing() -> bool:
        return killed_dir.is_dir() and any(p.name.endswith(".tmp") and p.is_dir() for p in killed_dir.iterdir())

    resumes = []
    # 1: mid-write, with at least one complete checkpoint behind it.
    proc = _start(killed_dir)
    _wait_until(proc, lambda: newest() >= 1 and writing())
    _kill(proc)
    resumes.append(expected_resume())
    # 2: right after a commit (rename done; the latest marker may not be written yet).
    proc, before = _start(killed_dir), newest()
    _wait_until(proc, lambda: newest() > before)
    output = _kill(proc)
    assert f"resumed {resumes[-1]} " in output  # never a partial: exactly the newest complete one
    resumes.append(expected_resume())
    # 3: at a random moment once it trains again.
    proc, before = _start(killed_dir), newest()
    _wait_until(proc, lambda: newest() > before)
    time.sleep(random.uniform(0.0, 0.3))
    output = _kill(proc)
    assert f"resumed {resumes[-1]} " in output
    resumes.append(expected_resume())
    # The restart of the same command finishes the run.
    proc = _start(killed_dir)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and f"resumed {resumes[-1]} " in output
    assert reference.wait(timeout=300) == 0

    assert [i for i, _ in dirs.complete_checkpoints(killed_dir)] == [TOTAL_STEPS - 1, TOTAL_STEPS]
    assert not any(p.name.endswith((".tmp", ".deleting")) for p in killed_dir.iterdir())
    straight = torch.load(reference_dir / "final.pt", weights_only=True)
    resumed = torch.load(killed_dir / "final.pt", weights_only=True)
    assert straight.keys() == resumed.keys()
    for key in straight:  # same steps, same data, same dropout draws: the same bits
        assert torch.equal(straight[key], resumed[key]), key
