"""The one atomic-write helper (fsdp2_backend/checkpoint/atomic.py): a reader sees the old file or the new one,
never a part; the data and the directory entry are fsync'd before the call returns."""
import os

import pytest

from fsdp2_backend.checkpoint import atomic

pytestmark = pytest.mark.unit


@pytest.fixture
def synced(monkeypatch):
    """The inodes fsync'd, in order (os.fsync recorded, then done)."""
    seen = []
    real = os.fsync

    def record(fd):
        seen.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", record)
    return seen


def test_write_replaces_whole_and_syncs_file_then_directory(tmp_path, synced):
    target = tmp_path / "marker.txt"
    target.write_text("7")
    atomic.write_atomically(target, "12")
    assert target.read_text() == "12"
    assert synced[-1] == tmp_path.stat().st_ino and target.stat().st_ino in synced  # the file, then its directory
    atomic.write_atomically(target, lambda f: f.write(b"\x00\x01"))
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker.txt"]  # no temporary left


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    target = tmp_path / "cache.npy"
    target.write_bytes(b"old")

    def half(f):
        f.write(b"new but")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic.write_atomically(target, half)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.npy"]


def test_publish_a_directory_syncs_every_file_before_the_rename(tmp_path, synced):
    tmp = tmp_path / "iter_0000003.tmp"
    (tmp / "rng").mkdir(parents=True)
    (tmp / "a.distcp").write_bytes(b"a")
    (tmp / "rng" / "rank_00000.pt").write_bytes(b"r")
    inodes = {p.stat().st_ino for p in tmp.rglob("*") if p.is_file()}
    atomic.publish(tmp, tmp_path / "iter_0000003")
    assert not tmp.exists() and (tmp_path / "iter_0000003" / "rng" / "rank_00000.pt").read_bytes() == b"r"
    assert inodes <= set(synced) and synced[-1] == tmp_path.stat().st_ino


def test_publish_a_file(tmp_path, synced):
    tmp = tmp_path / "data.bin.partial"
    tmp.write_bytes(b"tokens")
    atomic.publish(tmp, tmp_path / "data.bin")
    assert (tmp_path / "data.bin").read_bytes() == b"tokens" and not tmp.exists()
    assert (tmp_path / "data.bin").stat().st_ino in synced
