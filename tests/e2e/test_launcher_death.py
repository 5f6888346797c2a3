"""Workers do not outlive their launcher (issue 41): `kill -9` of torchrun alone (its workers run in sessions of
their own, so a signal to its process group does not reach them) ends both workers within seconds, and no new
`iter_*` checkpoint appears after the kill (they used to train on with parent 1 and write iter_0000030 into
--save). One 2-rank torchrun of a 2-layer model (~20 s)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.megatron_lines import FAULT_RUN_FLAGS
from tests.support.launchers import process_tree, start_entry, wait_for_log

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _checkpoints(save: Path):
    return sorted(p.name for p in save.iterdir() if p.name.startswith("iter_"))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_kill_9_of_torchrun_ends_its_workers(tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    at = FAULT_RUN_FLAGS.index("--save-interval")
    flags = FAULT_RUN_FLAGS[:at] + FAULT_RUN_FLAGS[at + 2:]
    workers = []
    run = start_entry([*flags, "--train-iters", "100000", "--save", str(save), "--save-interval", "3"], log, ranks=2)
    try:
        wait_for_log(run, log, r"successfully saved checkpoint from iteration\s+3 ")
        wait_for_log(run, log, r" iteration\s+4/")
        workers += [pid for pid in process_tree(run.pid) if pid != run.pid]
        assert len(workers) >= 2, workers
        before = _checkpoints(save)
        os.kill(run.pid, signal.SIGKILL)  # torchrun alone, as `kill -9 <torchrun pid>` does
        run.wait(timeout=30)
        deadline = time.monotonic() + 15
        while [pid for pid in workers if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], log.read_text()[-3000:]
        time.sleep(2)  # a worker left running would reach its next save (every 3 iterations) by now
        assert _checkpoints(save) == before and "iter_0000003" in before
    finally:  # whatever failed: nothing of this run left behind
        for pid in (process_tree(run.pid) if run.poll() is None else []) + [p for p in workers if _alive(p)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
