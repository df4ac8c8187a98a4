"""What only the POSIX storage does: files on disk, directory exchange, free space."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

import ddpckpt
from ddpckpt.storage import RenameCommit
from ddpckpt.storage._layout import is_temp_name
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


def _overwrite_failing(tmp_path, monkeypatch, fail) -> tuple[str, torch.nn.Module, str]:
    """Save ``step-1``, then replace it without RENAME_EXCHANGE while renames number
    ``fail`` (1: the committed one aside, 2: the new one in, 3: the old one back) fail
    with EIO; returns the path, the model saved first and the error's message."""
    monkeypatch.setenv("DDPCKPT_RENAME_EXCHANGE", "0")
    path = os.fspath(tmp_path / "step-1")
    old = torch.nn.Linear(3, 2)
    ddpckpt.save(path, model=old, step=1)
    count = {"n": 0}
    real = os.rename

    def rename(source, target):
        count["n"] += 1
        if count["n"] in fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO), source)
        return real(source, target)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename)
        with pytest.raises(ddpckpt.CheckpointWriteError) as caught:
            ddpckpt.save(path, model=torch.nn.Linear(3, 2), step=2, overwrite=True)
    return path, old, str(caught.value)


def _loads_as(path: str, model: torch.nn.Module) -> bool:
    loaded = torch.nn.Linear(3, 2)
    ddpckpt.load(path, model=loaded)
    return torch.equal(loaded.weight, model.weight) and torch.equal(loaded.bias, model.bias)


def test_without_exchange_a_failed_replacement_moves_the_old_checkpoint_back(
    tmp_path, monkeypatch
) -> None:
    path, old, message = _overwrite_failing(tmp_path, monkeypatch, fail={2})
    assert "back in place, unchanged" in message and "untouched" not in message
    assert _loads_as(path, old)
    assert [n for n in os.listdir(tmp_path) if not is_temp_name(n)] == ["step-1"]


def test_without_exchange_an_old_checkpoint_that_cannot_move_back_is_kept_and_put_back(
    tmp_path, monkeypatch, caplog
) -> None:
    """The storage fails the new one's rename and the move back alike (a server gone): the
    error names where the committed checkpoint is, and the next start puts it back."""
    path, old, message = _overwrite_failing(tmp_path, monkeypatch, fail={2, 3})
    kept = os.fspath(tmp_path / ".step-1.previous")
    assert f"moving the checkpoint it replaces back from {kept} failed too" in message
    assert "missing until the next" in message and "untouched" not in message
    assert not os.path.exists(path) and os.path.isdir(kept)
    with caplog.at_level("WARNING", logger="ddpckpt"):
        assert ddpckpt.latest(tmp_path) == path  # start-up: put back
    assert f"{path}: restored from {kept}" in caplog.text
    assert _loads_as(path, old)
    assert not os.path.exists(kept)


def test_without_exchange_a_save_to_a_checkpoint_kept_aside_is_refused(
    tmp_path, monkeypatch
) -> None:
    """``.step-1.previous`` *is* step-1 while step-1 is missing: a save there without
    ``overwrite`` is refused as for step-1 itself, and one with it replaces it."""
    path, old, _ = _overwrite_failing(tmp_path, monkeypatch, fail={2, 3})
    with pytest.raises(ddpckpt.errors.CheckpointExistsError):
        ddpckpt.save(path, model=torch.nn.Linear(3, 2), step=2)
    assert _loads_as(str(tmp_path / ".step-1.previous"), old)  # untouched
    new = torch.nn.Linear(3, 2)
    ddpckpt.save(path, model=new, step=2, overwrite=True)
    assert _loads_as(path, new)
    assert os.listdir(tmp_path) == ["step-1"]


def test_without_exchange_the_replaced_copy_goes_only_after_the_parent_is_synced(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("DDPCKPT_RENAME_EXCHANGE", "0")
    path = os.fspath(tmp_path / "step-1")
    ddpckpt.save(path, model=torch.nn.Linear(3, 2), step=1)
    order = []
    real_sync, real_rename = PosixStorage.sync_dir, os.rename
    monkeypatch.setattr(
        PosixStorage,
        "sync_dir",
        lambda self, where: (order.append(("sync", where)), real_sync(self, where))[1],
    )
    monkeypatch.setattr(
        os,
        "rename",
        lambda a, b: (
            order.append(("rename", os.path.basename(a), os.path.basename(b))),
            real_rename(a, b),
        )[1],
    )
    ddpckpt.save(path, model=torch.nn.Linear(3, 2), step=2, overwrite=True)
    renames = [entry[1:] for entry in order if entry[0] == "rename"]
    assert renames[0] == ("step-1", ".step-1.previous")
    assert renames[1][1] == "step-1" and is_temp_name(renames[1][0])
    assert renames[2][0] == ".step-1.previous" and is_temp_name(renames[2][1])
    between = order[order.index(("rename", *renames[1])) + 1 : order.index(("rename", *renames[2]))]
    assert ("sync", os.fspath(tmp_path)) in between


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
@pytest.mark.parametrize("how", ["other-users-parent", "writable-not-sticky", "through-a-link"])
def test_a_private_directory_under_one_another_user_could_replace_is_refused(tmp_path, how) -> None:
    # The directory itself may be ours and 0700, yet a user who may rename entries in a
    # directory above it can move it away and put one of theirs in its place.
    parent = tmp_path / "parent"
    parent.mkdir()
    if how == "other-users-parent":
        os.chown(parent, 65534, 65534)
        says = "belongs to"
    else:
        parent.chmod(0o777)  # no sticky bit
        says = "not sticky"
    target = parent / "fast"
    if how == "through-a-link":
        (tmp_path / "link").symlink_to(parent)
        target = tmp_path / "link" / "fast"
    problem = PosixStorage().make_private_dir(os.fspath(target))
    assert problem is not None and says in problem and os.fspath(parent) in problem
    parent.chmod(0o1777)  # sticky, as /dev/shm and /tmp are
    os.chown(parent, 0, 0)
    assert PosixStorage().make_private_dir(os.fspath(target)) is None
