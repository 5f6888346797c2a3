"""Real disk faults for the save tests: a read-only directory and a directory with little room."""
from __future__ import annotations

import contextlib
import os
import subprocess


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
