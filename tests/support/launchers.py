"""How tests start processes: the 2-rank gloo launcher (`run_distributed`, forked ranks), the in-process 1-rank
group (`init_one_rank_group`), torchrun's command line (`torchrun_command`) and the entry point run as a subprocess
(`run_pretrain`, under torchrun for several ranks; `run_command` for any command line), with the repository root and
the readers of the runs' logs.

No test picks a port for a process group: a port found free here and bound later by another process could be taken
in between (a CI run's torchrun died with EADDRINUSE that way). The forked ranks meet in a FileStore, the 1-rank
group uses an in-memory store, and torchrun binds and holds its own (`--standalone`).

A test module that launches processes marks itself (tests/conftest.py lists the markers; tests/tools/test_test_layout.py
checks that the marker and the launch go together)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def init_one_rank_group(backend: str = "gloo") -> None:
    """The default process group as one rank on an in-memory store (no port, no MASTER_ADDR/MASTER_PORT)."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def torchrun_command(ranks, *entry) -> list:
    """torchrun (this interpreter's) starting `ranks` workers on this host that run `entry` (a script and its
    arguments). `--standalone`: torchrun binds its rendezvous store on a port the kernel gives it (localhost:0) and
    holds it; the workers' env:// process group joins that store (torchrun hands them its address as
    MASTER_ADDR/MASTER_PORT, with TORCHELASTIC_USE_AGENT_STORE), so no port is picked before it is bound."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            *map(str, entry)]


def _spawn_entry(rank, world_size, store_file, fn, args, environ=None):
    import torch.distributed as dist

    if environ is not None:  # the forkserver's copy is from when it started: take the caller's current one
        os.environ.clear()
        os.environ.update(environ)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the group below has no address: nothing may join by one
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Every rank finishes its work before any tears the group down: a rank that destroyed its group (and
        # exited, taking rank 0's store with it) while another still used it made the other abort.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The work succeeded: leave without the interpreter's teardown, where a gloo background thread still being
    # destroyed now and then aborted a finished rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args) -> None:
    """Runs `fn(rank, world_size, *args)` in `world_size` gloo processes; re-raises a failure.

    `fn` must be a module-level function (it is pickled). Results travel through files the caller names.
    The ranks are forked from a forkserver that imported torch, transformers and the engine once per test session
    (a fresh interpreter per rank imported them again for every launch: about 6 s of CPU a rank).
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)
    store_dir = tempfile.mkdtemp(prefix="gloo-store-")  # a fresh FileStore per launch: the ranks meet in it
    try:
        mp.start_processes(_spawn_entry, args=(world_size, os.path.join(store_dir, "store"), fn, args,
                                               dict(os.environ)),
                           nprocs=world_size, join=True, start_method="forkserver")
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


# Imported once by the forkserver (it forks the ranks); a module that fails to import there is only skipped.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "transformers",
                       "fsdp2_backend.parallel.apply", "fsdp2_backend.build", "fsdp2_backend.training.trainer",
                       "tests.support.launchers"]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Megatron's training log line: iteration, consumed samples and the printed lm loss.
MEGATRON_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*? lm loss: ([0-9.E+-]+) \|")


def run_pretrain(flags, save_dir, *extra, ranks: int = 1):
    """Runs pretrain_fsdp2.py with `flags --save save_dir *extra` (under torchrun when ranks > 1); asserts it
    succeeds and returns ({iteration: (consumed samples, printed lm loss text)}, the whole log)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    entry = [os.path.join(REPO, "pretrain_fsdp2.py"), *flags, "--save", str(save_dir), *extra]
    if ranks == 1:
        env.pop("WORLD_SIZE", None)
        command = [sys.executable, *entry]
    else:
        command = torchrun_command(ranks, *entry)
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    return {int(it): (int(consumed), loss) for it, consumed, loss in MEGATRON_LINE.findall(log)}, log


def run_command(command, env_extra, timeout):
    """Runs `command` (an entry point or tool) from the repository root with the launch variables of this
    process removed and `env_extra` added; returns the CompletedProcess (text output captured)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env_extra}
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def failure_report(result, command) -> str:
    """A failed run's exit code, command line and the tails of its output, for an assertion message."""
    return (f"exit {result.returncode}\n$ {' '.join(command)}\n--- stderr (tail)\n{result.stderr[-4000:]}\n"
            f"--- stdout (tail)\n{result.stdout[-2000:]}")


# Where a Megatron log line starts: rank 0's checkpoint message and the last rank's log line share one stdout, and
# unbuffered (PYTHONUNBUFFERED) a print's text and its newline are two writes, so a line can start mid-line.
LOG_LINE_START = re.compile(r" \[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{6}\] iteration ")


def train_lines(log, parse_train_line):
    """Every Megatron training line of `log` that `parse_train_line` parses, wherever in a line it starts."""
    return [parsed for line in log.splitlines() for start in LOG_LINE_START.finditer(line)
            if (parsed := parse_train_line(line[start.start():]))]


# The environment of the entry point's runs: offline, one thread, and no WORLD_SIZE of the test's own process.
ENTRY_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
ENTRY_ENV.pop("WORLD_SIZE", None)


def entry_command(args, ranks):
    """The command line of pretrain_fsdp2.py with `args`: this interpreter, or torchrun when ranks > 1."""
    entry = [os.path.join(REPO, "pretrain_fsdp2.py"), *map(str, args)]
    if ranks == 1:
        return [sys.executable, *entry]
    return torchrun_command(ranks, *entry)


def start_entry(args, log: Path, ranks=1) -> subprocess.Popen:
    """A run in a session of its own, its output (stdout and stderr) in `log`."""
    return subprocess.Popen(entry_command(args, ranks), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=ENTRY_ENV, cwd=REPO, start_new_session=True)


def run_entry(args, ranks=1):
    """pretrain_fsdp2.py with `args` (under torchrun when ranks > 1), to its end; returns the CompletedProcess."""
    return subprocess.run(entry_command(args, ranks), capture_output=True, text=True, env=ENTRY_ENV, cwd=REPO,
                          timeout=600)


def wait_for_log(proc: subprocess.Popen, log: Path, pattern: str, timeout=300.0) -> re.Match:
    """The first match of `pattern` in the log of the live run `proc`; fails if the run ends or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(pattern, log.read_text())
        if match:
            return match
        assert proc.poll() is None, f"the run ended first:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def process_tree(pid: int):
    """`pid` and all its descendants (torchrun's workers run in sessions of their own: a process group is not
    enough), read from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def signal_tree(pid: int, sig) -> None:
    """Sends `sig` to `pid` and all its descendants."""
    for member in process_tree(pid):
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass
