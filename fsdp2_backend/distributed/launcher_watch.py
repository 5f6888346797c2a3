"""A torchrun worker ends with its launcher.

torchrun starts each worker in a session of its own, so a `kill -9` of torchrun (or of the launching shell's
process group) used to leave the workers running with parent 1: they kept training and wrote checkpoints into
--save after the user had stopped the run. `end_with_launcher()` (called first thing by a worker) asks the kernel
to SIGKILL this process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`, through ctypes: no dependency);
elsewhere a daemon thread watches the parent pid once a second and does the same.

Why SIGKILL and not SIGTERM: SIGTERM is Megatron's --exit-signal-handler signal, which saves a checkpoint — a
save the user did not ask for, by ranks that no longer form a job (a collective save could hang). SIGKILL stops
at once; a save in progress is never renamed into its `iter_*` directory (training/checkpoint.py's commit
protocol), so no half-written checkpoint appears — the same guarantee as `kill -9` of the workers themselves.
Only workers of torchrun (TORCHELASTIC_RUN_ID set) are armed: a single process belongs to the user's shell.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 1.0


def _set_parent_death_signal(sig: int) -> bool:
    """True when the kernel will send `sig` at the parent's death (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def end_with_launcher(environ=os.environ) -> str:
    """Arms this torchrun worker to end when its launcher does; returns how ("prctl", "watchdog" or "" when not
    a torchrun worker)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return ""
    parent = os.getppid()
    if _set_parent_death_signal(signal.SIGKILL):
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)
        return "prctl"
    threading.Thread(target=_watch, args=(parent,), name="launcher-watch", daemon=True).start()
    return "watchdog"
