"""Writing files so that a reader, or a machine that loses power, sees all of them or nothing: the one place that
does it (checkpoints and their markers, the HF export, datasets and their caches).

- `write_atomically(path, data)`: a temporary file in the same directory, written, flushed and fsync'd, renamed
  over `path`, and the directory fsync'd (the rename itself is durable only then). A failure removes the temporary.
- `publish(tmp, final)`: a file or a whole directory already written under a temporary name becomes visible under
  its final one — the file (every file of the directory) and the directory fsync'd first, then one rename, then the
  parent fsync'd. A rename within one file system is atomic on POSIX, so `final` is complete or absent.

Standard library only, torch-free: every layer at or above the file formats uses it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, Union

Data = Union[bytes, str, Callable[[BinaryIO], object]]


def fsync_dir(path: os.PathLike | str) -> None:
    """fsync a directory (makes a rename or a new entry in it durable); a no-op where directories cannot be
    opened or synced (some network and Windows file systems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: os.PathLike | str, data: Data) -> None:
    """Writes `data` (bytes, text as UTF-8, or a function writing to a binary file) to `path` atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # same directory: the rename stays on one file system
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def publish(tmp: os.PathLike | str, final: os.PathLike | str) -> None:
    """Makes `tmp` (a fully written file or directory) visible as `final` with one rename, durably. An existing
    `final` file is replaced; an existing directory must have been moved away by the caller (a rename does not
    replace a non-empty directory)."""
    tmp, final = Path(tmp), Path(final)
    if tmp.is_dir():
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync_file(Path(root) / name)
            fsync_dir(root)
    else:
        _fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


__all__ = ["fsync_dir", "write_atomically", "publish"]
