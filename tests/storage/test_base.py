"""The Storage protocol's semantics, the same for every implementation (``store`` fixture)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from collections.abc import Iterator

import pytest
import torch

import ddpckpt
from ddpckpt.errors import CheckpointExistsError, IncompleteCheckpointError
from ddpckpt.storage import (
    ManifestLastCommit,
    RenameCommit,
    Storage,
    storage_for,
)
from ddpckpt.storage._layout import MANIFEST, is_temp_name, new_token, temp_name
from ddpckpt.storage._location import locate
from ddpckpt.storage._memory import SCHEME


def _at(root: str) -> tuple[Storage, str]:
    return storage_for(root), root


@pytest.fixture(params=["posix", "posix-no-exchange", "memory", "s3", "fsspec"])
def store(request, tmp_path) -> Iterator[tuple[Storage, str]]:
    """``(storage, root)``: an empty directory (also as on NFS or Lustre, where overwrites
    take two renames), memory prefix, S3 prefix or prefix of fsspec's in-memory file system
    to work under."""
    if request.param.startswith("posix"):
        if request.param == "posix-no-exchange":  # not a parameter: see s3_root
            request.getfixturevalue("monkeypatch").setenv("DDPCKPT_RENAME_EXCHANGE", "0")
        yield _at(os.fspath(tmp_path))
        return
    if request.param == "s3":
        yield _at(request.getfixturevalue("s3_root"))
        return
    if request.param == "fsspec":
        yield _at(request.getfixturevalue("fsspec_root"))
        return
    name = f"test-{uuid.uuid4().hex[:8]}"
    storage, root = _at(f"{SCHEME}{name}/root")
    yield storage, root
    storage.clear(name)


def test_exclusive_create_refuses_an_existing_object(store) -> None:
    storage, root = store
    storage.make_dirs(root)
    storage.write_new(f"{root}/a", b"first")
    with pytest.raises(FileExistsError):
        storage.create(f"{root}/a")
    with pytest.raises(FileExistsError):
        storage.write_new(f"{root}/a", b"second")
    assert storage.read(f"{root}/a") == b"first"


def test_a_streamed_write_is_read_back_by_ranges(store) -> None:
    storage, root = store
    storage.make_dirs(root)
    data = bytes(range(256)) * 1000
    with storage.create(f"{root}/blob") as writer:
        for start in range(0, len(data), 7000):
            writer.write(memoryview(data)[start : start + 7000])
        writer.sync()
    assert storage.size(f"{root}/blob") == len(data)
    reader = storage.open(f"{root}/blob")
    try:
        assert reader.size == len(data)
        buffer = bytearray(100)
        assert reader.read_into(memoryview(buffer), 1000) == 100
        assert bytes(buffer) == data[1000:1100]
        assert reader.read_into(memoryview(buffer), len(data) - 10) == 10
        assert bytes(buffer[:10]) == data[-10:]
        assert reader.read_into(memoryview(buffer), len(data)) == 0
        mapped = reader.map()
        assert bytes(mapped) == data
        mapped[0] = 99  # private to this reader: the stored bytes stay
    finally:
        reader.close()
    assert storage.read(f"{root}/blob") == data


def test_a_reader_keeps_the_bytes_it_opened(store) -> None:
    storage, root = store
    storage.make_dirs(root)
    storage.write_new(f"{root}/a", b"old bytes")
    reader = storage.open(f"{root}/a")
    storage.replace(f"{root}/a", b"new bytes!")
    buffer = bytearray(9)
    reader.read_into(memoryview(buffer), 0)
    reader.close()
    assert bytes(buffer) == b"old bytes"
    assert storage.read(f"{root}/a") == b"new bytes!"


def test_missing_objects_raise_file_not_found(store) -> None:
    storage, root = store
    for call in (storage.open, storage.read, storage.size, storage.delete, storage.list):
        with pytest.raises(FileNotFoundError):
            call(f"{root}/nothing")
    assert not storage.exists(f"{root}/nothing") and not storage.is_dir(f"{root}/nothing")
    storage.delete_tree(f"{root}/nothing")  # missing is fine


def test_list_walk_and_delete_tree(store) -> None:
    storage, root = store
    for name in ("d/a", "d/sub/b", "d/sub/c", "e"):
        storage.make_dirs(storage.parent(f"{root}/{name}"))
        storage.write_new(f"{root}/{name}", name.encode())
    assert sorted(storage.list(root)) == ["d", "e"]
    assert sorted(storage.list(f"{root}/d")) == ["a", "sub"]
    assert sorted(storage.walk(f"{root}/d")) == ["a", "sub/b", "sub/c"]
    assert storage.is_dir(f"{root}/d") and not storage.is_dir(f"{root}/e")
    assert storage.tree_bytes(f"{root}/d") == len("d/a") + 2 * len("d/sub/b")
    storage.delete_tree(f"{root}/d")
    assert storage.list(root) == ["e"] and not storage.exists(f"{root}/d/sub/b")
    storage.delete(f"{root}/e")
    assert not storage.exists(f"{root}/e")


def test_replace_is_whole_and_leaves_no_temporary(store) -> None:
    storage, root = store
    storage.make_dirs(root)
    storage.replace(f"{root}/latest", b"step-1\n")
    storage.replace(f"{root}/latest", b"step-2\n")
    assert storage.read(f"{root}/latest") == b"step-2\n"
    assert storage.list(root) == ["latest"]


def test_touch_makes_an_object_young(store) -> None:
    storage, root = store
    storage.make_dirs(root)
    storage.write_new(f"{root}/.lock", b"{}")
    storage.touch(f"{root}/.lock")
    assert 0 <= storage.age(f"{root}/.lock") < 60


def test_rename_moves_a_tree_and_refuses_a_non_empty_target(store) -> None:
    storage, root = store
    for name in ("src/a", "src/b", "other/c"):
        storage.make_dirs(storage.parent(f"{root}/{name}"))
        storage.write_new(f"{root}/{name}", name.encode())
    with pytest.raises(OSError) as caught:
        storage.rename(f"{root}/src", f"{root}/other")
    assert caught.value.errno in (errno.EEXIST, errno.ENOTEMPTY)
    storage.rename(f"{root}/src", f"{root}/dst")
    assert sorted(storage.walk(f"{root}/dst")) == ["a", "b"]
    assert not storage.exists(f"{root}/src")


def test_temporary_names_are_recognised() -> None:
    name = temp_name("/run/step-00000001", new_token()).rsplit("/", 1)[1]
    assert is_temp_name(name) and not is_temp_name("step-00000001")
    assert temp_name("memory://t/run/x", "ab") == "memory://t/run/.x.tmp-ab"


def _write_checkpoint_files(storage, staging: str, manifest: bytes | None) -> None:
    storage.make_dirs(staging)
    storage.write_new(f"{staging}/model-0.safetensors", b"data")
    if manifest is not None:
        storage.write_new(f"{staging}/{MANIFEST}", manifest)


def _save_files(strategy, storage, final: str, staging: str) -> None:
    strategy.begin(storage, final, staging, overwrite=False)
    _write_checkpoint_files(storage, staging, b"two")
    strategy.publish(storage, staging, final, overwrite=False)


@pytest.mark.parametrize("strategy", [RenameCommit(), ManifestLastCommit()], ids=type)
def test_commit_publishes_all_at_once_and_refuses_an_existing_one(store, strategy) -> None:
    storage, root = store
    final = f"{root}/ckpt"
    staging = strategy.staging(storage, final, "t1")
    strategy.begin(storage, final, staging, overwrite=False)
    _write_checkpoint_files(storage, staging, b"one")
    strategy.publish(storage, staging, final, overwrite=False)
    assert storage.read(f"{final}/{MANIFEST}") == b"one"
    assert strategy.exists(storage, final)
    assert [n for n in storage.list(root) if is_temp_name(n)] == []

    staging = strategy.staging(storage, final, "t2")
    with pytest.raises(FileExistsError):  # refused at the latest when publishing
        _save_files(strategy, storage, final, staging)
    strategy.abort(storage, staging, final)
    assert storage.read(f"{final}/{MANIFEST}") == b"one"

    staging = strategy.staging(storage, final, "t3")
    strategy.begin(storage, final, staging, overwrite=True)
    _write_checkpoint_files(storage, staging, b"three")
    strategy.publish(storage, staging, final, overwrite=True)
    assert storage.read(f"{final}/{MANIFEST}") == b"three"
    assert storage.list(root) == ["ckpt"]


@pytest.mark.parametrize("strategy", [RenameCommit(), ManifestLastCommit()], ids=type)
def test_a_crash_between_data_and_manifest_leaves_no_checkpoint(store, strategy) -> None:
    storage, root = store
    final = f"{root}/ckpt"
    staging = strategy.staging(storage, final, "t1")
    strategy.begin(storage, final, staging, overwrite=False)
    _write_checkpoint_files(storage, staging, manifest=None)  # the process dies here
    assert not strategy.exists(storage, final)
    assert not storage.exists(f"{final}/{MANIFEST}")
    # The next save to the same place succeeds; the leftovers are never part of it.
    staging = strategy.staging(storage, final, "t2")
    strategy.begin(storage, final, staging, overwrite=False)
    storage.write_new(f"{staging}/{MANIFEST}", b"m")
    strategy.publish(storage, staging, final, overwrite=False)
    assert storage.walk(final) == [MANIFEST]


@pytest.mark.parametrize("strategy", [RenameCommit(), ManifestLastCommit()], ids=type)
def test_discard_and_set_aside(store, strategy) -> None:
    storage, root = store
    for name in ("a", "b"):
        final = f"{root}/{name}"
        staging = strategy.staging(storage, final, name)
        strategy.begin(storage, final, staging, overwrite=False)
        _write_checkpoint_files(storage, staging, b"m")
        strategy.publish(storage, staging, final, overwrite=False)
    strategy.discard(storage, f"{root}/a")
    strategy.set_aside(storage, f"{root}/b", f"{root}/b.corrupt-1")
    assert [n for n in storage.list(root) if not is_temp_name(n)] == ["b.corrupt-1"]
    assert sorted(storage.walk(f"{root}/b.corrupt-1")) == [MANIFEST, "model-0.safetensors"]


def test_a_save_without_manifest_is_no_checkpoint_and_is_replaced(store) -> None:
    """Through the public API: data objects without a manifest (a crash before the commit)
    are reported as incomplete, skipped by latest(), and a new save there succeeds."""
    storage, root = store
    path = f"{root}/ckpt"
    storage.make_dirs(path)
    storage.write_new(f"{path}/model-0.safetensors", b"partial")
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        ddpckpt.load(path, model=torch.nn.Linear(2, 2))
    assert ddpckpt.latest(root) is None
    model = torch.nn.Linear(2, 2)
    if isinstance(storage.commit, RenameCommit):  # a directory is in the way
        with pytest.raises(CheckpointExistsError):
            ddpckpt.save(path, model=model)
        ddpckpt.save(path, model=model, overwrite=True)
    else:
        ddpckpt.save(path, model=model)
    fresh = torch.nn.Linear(2, 2)
    ddpckpt.load(path, model=fresh)
    assert torch.equal(fresh.weight, model.weight)
    assert ddpckpt.latest(root) == path


def test_storage_for_picks_the_storage_by_scheme() -> None:
    from ddpckpt.storage._memory import MemoryStorage
    from ddpckpt.storage._posix import PosixStorage
    from ddpckpt.storage._registry import mount

    assert isinstance(storage_for("/tmp/x"), PosixStorage)
    assert isinstance(storage_for("relative/x"), PosixStorage)
    assert isinstance(storage_for("memory://t/x"), MemoryStorage)
    with pytest.raises(ValueError, match="no storage for nope:// URLs"):
        storage_for("nope://bucket/x")
    mine = MemoryStorage()
    mount("nope://bucket", mine)
    try:
        assert storage_for("nope://bucket/run/x") is mine
        with pytest.raises(ValueError):
            storage_for("nope://other/x")
    finally:
        mount("nope://bucket", None)


@pytest.mark.parametrize("strategy", [RenameCommit(), ManifestLastCommit()], ids=type)
def test_abort_logs_a_storage_failure_instead_of_masking_the_save_error(
    store, strategy, monkeypatch, caplog
) -> None:
    """abort runs while the save's own error propagates; the store that failed the save
    (a server gone away) often fails the cleanup too, which must not replace that error."""
    storage, root = store
    final = f"{root}/ckpt"
    staging = strategy.staging(storage, final, "t1")
    strategy.begin(storage, final, staging, overwrite=False)
    _write_checkpoint_files(storage, staging, manifest=None)

    def unreachable(location: str) -> None:
        raise ConnectionError(errno.ECONNREFUSED, "connection refused", location)

    monkeypatch.setattr(storage, "delete_tree", unreachable)
    monkeypatch.setattr(storage, "exists", lambda location: unreachable(location))
    with caplog.at_level("WARNING", logger="ddpckpt"):
        strategy.abort(storage, staging, final)
    assert "could not remove what the failed save left" in caplog.text
    assert "connection refused" in caplog.text


_MUTATIONS = ("create", "replace", "delete", "delete_tree", "rename", "copy", "touch")


def test_an_overwrite_failing_at_any_step_leaves_the_old_or_the_new_checkpoint(
    store, monkeypatch
) -> None:
    """A fault injected before each storage operation of ``save(overwrite=True)`` in turn:
    afterwards the path always loads, as the old or the new state, never neither."""
    storage, root = store
    storage.make_dirs(root)
    path = f"{root}/step-1"
    old, new = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ddpckpt.save(path, model=old, step=1)
    calls = {"count": 0, "fail_at": 0}

    def faulty(method: str):
        real = getattr(storage, method)

        def call(*args, **kwargs):
            calls["count"] += 1
            if calls["count"] == calls["fail_at"]:
                raise OSError(errno.EIO, f"injected fault in {method}", args[0])
            return real(*args, **kwargs)

        return call

    for method in _MUTATIONS:
        monkeypatch.setattr(storage, method, faulty(method))
    outcomes = []
    for fail_at in range(1, 40):
        calls.update(count=0, fail_at=fail_at)
        with contextlib.suppress(ddpckpt.CheckpointWriteError):  # or it succeeds
            ddpckpt.save(path, model=new, step=2, overwrite=True)
        fired, calls["fail_at"] = calls["count"] >= fail_at, 0
        loaded = torch.nn.Linear(3, 2)
        step = ddpckpt.load(path, model=loaded).step  # committed, whatever failed
        assert torch.equal(loaded.weight, (new if step == 2 else old).weight)
        outcomes.append(step)
        if not fired:
            break
        ddpckpt.save(path, model=old, step=1, overwrite=True)  # the next try starts over
    assert outcomes[-1] == 2 and 1 in outcomes  # the faults were met, the last save worked
    listed = ddpckpt.verify(path)
    assert listed.step == 2
    if isinstance(storage.commit, ManifestLastCommit):  # the replaced objects are gone
        manifest = json.loads(storage.read(f"{path}/{MANIFEST}"))
        assert sorted(storage.walk(path)) == sorted([MANIFEST, *manifest["files"]])


@pytest.mark.parametrize("remove", ["resume", "clean"])
def test_an_overwrite_killed_before_its_commit_is_a_leftover_ls_lists_and_resume_or_clean_removes(
    store, monkeypatch, capsys, remove
) -> None:
    """On object stores an overwrite writes under ``step-N/.next-<token>/`` while the old
    checkpoint stays committed; a process killed before the manifest switch never runs its
    cleanup, so those objects stay inside ``step-N``."""
    storage, root = store
    if not isinstance(storage.commit, ManifestLastCommit):
        pytest.skip("a rename commit leaves temporaries beside the run's checkpoints")
    from ddpckpt._cli.main import main
    from ddpckpt._run.rundir import find_leftovers

    run = f"{root}/run"
    model = torch.nn.Linear(3, 2)
    with ddpckpt.Checkpointer(run, model=model) as checkpointer:
        checkpointer.save(step=1)
    step = f"{run}/step-00000001"

    def killed(*args, **kwargs) -> None:
        raise OSError(errno.EIO, "the process dies here", step)

    with monkeypatch.context() as patch:  # a kill: the switch and the cleanup never run
        patch.setattr(ManifestLastCommit, "publish", killed)
        patch.setattr(ManifestLastCommit, "remove_leftovers", lambda *args: None)
        with pytest.raises(ddpckpt.CheckpointWriteError):
            ddpckpt.save(step, model=torch.nn.Linear(3, 2), step=1, overwrite=True)
    [part] = [name for name in storage.list(step) if name.startswith(".next-")]
    [leftover] = find_leftovers(locate(run))
    assert (leftover.name, leftover.kind) == (f"step-00000001/{part}", "temporary")
    assert leftover.nbytes == storage.tree_bytes(f"{step}/{part}") > 0
    capsys.readouterr()
    main(["ls", run])
    assert f"step-00000001/{part}" in capsys.readouterr().out
    if remove == "resume":
        with ddpckpt.Checkpointer(run, model=torch.nn.Linear(3, 2)) as checkpointer:
            assert checkpointer.resume().step == 1
    else:
        assert main(["clean", run]) == 0
    assert not [name for name in storage.list(step) if name.startswith(".next-")]
    assert find_leftovers(locate(run)) == []
    loaded = torch.nn.Linear(3, 2)
    ddpckpt.load(step, model=loaded)  # the committed checkpoint is whole
    assert torch.equal(loaded.weight, model.weight)


@pytest.mark.parametrize("old", ["configure", "mount", "resolve"])
def test_the_registrys_other_functions_still_work_with_a_warning(old: str) -> None:
    """One way to add a backend (``register``) and one to look one up (``storage_for``)."""
    import ddpckpt.storage
    from ddpckpt.storage import _registry

    with pytest.warns(DeprecationWarning, match=rf"ddpckpt\.storage\.{old} is deprecated"):
        function = getattr(ddpckpt.storage, old)
    assert function is getattr(_registry, old)
    with pytest.raises(AttributeError, match="no_such"):
        ddpckpt.storage.no_such  # noqa: B018
