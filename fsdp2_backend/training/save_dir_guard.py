"""One run per save directory: a lock file taken at start-up, which is also the proof that the directory is writable.

Two runs saving into one `--save` directory overwrite each other's checkpoints, and the second may resume from the
first one's newest checkpoint while it is still being trained. `SaveDirGuard.acquire(save_dir, ...)` (every rank,
right after the process group exists, before anything is read from the directory) has rank 0 create
`SAVE_DIR/.fsdp2_run.lock` exclusively (`O_CREAT | O_EXCL`: atomic on local and NFS v3+ file systems), holding the
host, the pid and the start time; every rank learns the outcome from rank 0, so all leave together with the same
one-line error. A lock whose process is gone (same host, no such pid: a killed run) is stale: it is replaced, and
that is said once. A lock from another host cannot be checked from here: the error says whose it is and that
deleting the file is safe once that run has ended. `release()` removes the lock (only our own).

Creating the lock is the start-up write probe too: a read-only or unwritable `--save` fails here, in one line,
instead of at the first save (torch-free validation checks the permission bits beforehand; root ignores them).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional, Tuple

from fsdp2_backend.usage_errors import UsageError

LOCK_FILE = ".fsdp2_run.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_lock(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


def take_lock(save_dir: Path) -> Tuple[Optional[str], Optional[str]]:
    """(error, notice): creates the lock in `save_dir` (made if missing) for this process; `error` is the one line
    to print when another live run holds it or the directory cannot be written, `notice` says a stale lock was
    replaced. Single process, no collectives."""
    flag = "training.output_dir (--save)"
    path = save_dir / LOCK_FILE
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    notice = None
    for _ in range(2):
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            same_host = holder.get("host") == me["host"]
            pid = holder.get("pid")
            if same_host and isinstance(pid, int) and not _pid_alive(pid):
                notice = f"{flag}: removed the stale lock of an earlier run ({_describe(holder)}; no longer running)"
                path.unlink(missing_ok=True)
                continue
            where = ("" if same_host else f" (another host: if that run has ended, delete {path})")
            return (f"{flag}: {save_dir} is in use by another run ({_describe(holder)}){where} — give this run its "
                    f"own --save directory, or wait for that run to end"), None
        except OSError as exc:
            return (f"{flag}: cannot write to {save_dir} ({exc.strerror or exc}) — give a writable directory"
                    f"{' with free space' if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ''}"), None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as exc:
            path.unlink(missing_ok=True)
            return f"{flag}: cannot write to {save_dir} ({exc.strerror or exc}) — free space or fix permissions", None
        return None, notice
    return f"{flag}: {path} keeps reappearing — another run is starting there; give this run its own --save", None


class SaveDirGuard:
    """The lock of one run's save directory (see the module docstring). `acquire` is collective."""

    def __init__(self, save_dir: Optional[Path], owner: bool):
        self.save_dir, self.owner = save_dir, owner

    @classmethod
    def acquire(cls, config, rank: int, world_size: int) -> "SaveDirGuard":
        """Takes the lock on rank 0 and shares the outcome (UsageError on every rank when refused)."""
        t = config.training
        if not (t.save_checkpoints and t.output_dir):
            return cls(None, False)
        save_dir = Path(t.output_dir)
        error = notice = None
        if rank == 0:
            error, notice = take_lock(save_dir)
        if world_size > 1:
            import torch.distributed as dist

            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error:
            raise UsageError(error)
        if notice:
            print(f"notice: {notice}", flush=True)
        return cls(save_dir, rank == 0)

    def release(self) -> None:
        """Removes the lock if this process holds it (idempotent)."""
        if not self.owner or self.save_dir is None:
            return
        path = self.save_dir / LOCK_FILE
        if _read_lock(path).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
        self.owner = False
