"""ExitTimer: the time limit alone on one process, and the MAX decision shared by 2 gloo ranks."""
import json
import os
import tempfile
import time

from fsdp2_backend.training.exit_conditions import ExitTimer
from tests.support.launchers import run_distributed


def test_single_process_exits_only_past_the_limit():
    assert not ExitTimer(None, start=time.time() - 3600).should_exit()  # unset: never
    assert not ExitTimer(5.0).should_exit()
    assert ExitTimer(5.0, start=time.time() - 6 * 60).should_exit()
    timer = ExitTimer(1.0, start=time.time() - 90)
    assert 1.49 < timer.elapsed_minutes() < 1.6


def _two_ranks(rank, world_size, out_dir):
    now = time.time()
    # Rank 0 started 10 minutes ago and is past its 5-minute limit; rank 1 started now. Then neither is.
    late = ExitTimer(5.0, start=now - 600 if rank == 0 else now).should_exit()
    fresh = ExitTimer(5.0, start=now).should_exit()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"late": late, "fresh": fresh}, f)


def test_every_rank_stops_when_one_rank_is_out_of_time():
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(_two_ranks, 2, out_dir)
        results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    assert results == [{"late": True, "fresh": False}] * 2
