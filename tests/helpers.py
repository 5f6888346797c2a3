"""Shared test helpers: tiny real models and tokenizers built locally, and a 2-rank gloo launcher.

Nothing here stands in for the code under test: models are real transformers models built from configs,
tokenizers are real byte-level BPE tokenizers trained on local text (tools/demo_assets.py, shared with the demo).
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys

from fsdp2_backend.cli.demo_assets import (build_tiny_model_dir, stdlib_texts, tiny_qwen3_config,  # noqa: F401
                               train_bytelevel_tokenizer)


def tiny_model_dir(path, seed: int, vocab_size: int = 300, **overrides) -> str:
    """An HF directory holding a locally trained tokenizer and a seeded tiny Qwen3 sized to its vocabulary."""
    tokenizer = train_bytelevel_tokenizer(path, vocab_size=vocab_size)
    build_tiny_model_dir(path, vocab_size=len(tokenizer), seed=seed, **overrides)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank, world_size, port, fn, args, environ=None):
    import torch.distributed as dist

    if environ is not None:  # the forkserver's copy is from when it started: take the caller's current one
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
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
    mp.start_processes(_spawn_entry, args=(world_size, free_port(), fn, args, dict(os.environ)),
                       nprocs=world_size, join=True, start_method="forkserver")


# Imported once by the forkserver (it forks the ranks); a module that fails to import there is only skipped.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "transformers",
                       "fsdp2_backend.parallel.apply", "fsdp2_backend.build", "fsdp2_backend.training.trainer",
                       "tests.helpers"]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(free_port()), *entry]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    return {int(it): (int(consumed), loss) for it, consumed, loss in MEGATRON_LINE.findall(log)}, log


class SaveRecorder:
    """Stands for the job's Checkpointer during the loop: records its save points as (iteration, reason)."""

    def __init__(self):
        self.saves = []

    def save(self, iteration, reason, train_iters=None):
        self.saves.append((iteration, reason))

    def close(self):
        pass



@contextlib.contextmanager
def read_only_dir(path):
    """`path` (a directory) made read-only for this process, for real: a read-only bind mount when running as
    root (root writes through file modes), else mode 0555. Skips where neither can be done."""
    import pytest

    path = str(path)
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield path
        finally:
            os.chmod(path, 0o755)
        return
    if subprocess.run(["mount", "--bind", path, path], capture_output=True).returncode:
        pytest.skip("root without mount rights: no way to make a directory read-only")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", path], capture_output=True).returncode:
            pytest.skip("root without remount rights: no way to make a directory read-only")
        yield path
    finally:
        subprocess.run(["umount", path], capture_output=True)


@contextlib.contextmanager
def small_disk(path, size_kib: int):
    """A directory `path` with room for about `size_kib` KiB: a tmpfs of that size when mounting is allowed (a real
    ENOSPC), else None (the caller then limits the file size of its child process: a real EFBIG)."""
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                      capture_output=True).returncode:
        yield None
        return
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
