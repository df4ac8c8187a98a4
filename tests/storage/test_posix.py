"""What only the POSIX storage does: files on disk, directory exchange, free space."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from ddpckpt.storage import RenameCommit
from ddpckpt.storage._base import is_temp_name
from ddpckpt.storage._posix import PosixStorage

storage = PosixStorage()


def test_objects_are_plain_files(tmp_path) -> None:
    path = os.fspath(tmp_path / "a")
    storage.write_new(path, b"bytes")
    assert (tmp_path / "a").read_bytes() == b"bytes"
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o644 == 0o644
    assert isinstance(storage.commit, RenameCommit)


def test_a_failed_write_raises_and_the_partial_file_is_never_synced(tmp_path, monkeypatch) -> None:
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writer = storage.create(os.fspath(tmp_path / "a"))
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as caught, writer:
        writer.write(b"x" * 10)
    assert caught.value.errno == errno.ENOSPC


def test_a_large_streamed_write_hands_pages_to_the_disk_early(tmp_path, monkeypatch) -> None:
    hints = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: hints.append(a[1:]) or real(*a))
    chunk = b"\0" * (8 << 20)
    with storage.create(os.fspath(tmp_path / "big")) as writer:
        for _ in range(5):
            writer.write(chunk)
        writer.sync()
    assert hints == [(0, 32 << 20, os.POSIX_FADV_DONTNEED)]
    assert os.path.getsize(tmp_path / "big") == 40 << 20


def test_map_is_copy_on_write(tmp_path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    reader = storage.open(os.fspath(tmp_path / "a"))
    mapped = reader.map()
    mapped[0] = ord("z")
    reader.close()
    assert (tmp_path / "a").read_bytes() == b"abc"
    assert storage.open(os.fspath(tmp_path / "a")).map() is not None
    (tmp_path / "empty").write_bytes(b"")
    assert storage.open(os.fspath(tmp_path / "empty")).map() is None


def test_overwriting_commit_swaps_directories_and_leaves_no_temporary(tmp_path) -> None:
    commit = storage.commit
    final = os.fspath(tmp_path / "ckpt")
    for content in (b"old", b"new"):
        staging = commit.staging(storage, final, content.decode())
        assert is_temp_name(os.path.basename(staging))
        commit.begin(storage, final, staging, overwrite=True)
        storage.write_new(os.path.join(staging, "manifest.json"), content)
        commit.publish(storage, staging, final, overwrite=True)
    assert (tmp_path / "ckpt" / "manifest.json").read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_free_bytes_of_a_path_not_made_yet_is_its_file_system_s(tmp_path) -> None:
    free = storage.free_bytes(os.fspath(tmp_path / "not" / "yet"))
    assert free is not None and free > 0
    stats = os.statvfs(tmp_path)
    assert abs(free - stats.f_bavail * stats.f_frsize) < 1 << 30


def test_relative_paths_keep_their_spelling(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert storage.commit.staging(storage, "ckpt", "t").startswith(".ckpt.tmp-")
    assert storage.parent("ckpt") == os.fspath(tmp_path)


def test_deleting_what_does_not_exist_on_a_read_only_file_system_is_no_error(
    tmp_path, monkeypatch
) -> None:
    """A save that failed on a read-only file system made no temporary directory, yet its
    clean-up warned that it "could not remove what the failed save left": the kernel
    answers unlink of a missing path there with EROFS, not ENOENT."""

    def read_only_unlink(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(os, "unlink", read_only_unlink)
    storage.delete_tree(os.fspath(tmp_path / ".step-00000001.tmp-0a1b2c3d4e5f-0"))
