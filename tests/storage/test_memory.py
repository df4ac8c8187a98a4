"""What only the in-memory storage does: named stores, implicit directories, threads."""

from __future__ import annotations

import threading

import pytest

from ddpckpt.storage import ManifestLastCommit, storage_for
from ddpckpt.storage._memory import MemoryStorage


def test_each_name_is_its_own_store_and_clear_forgets_one() -> None:
    storage = MemoryStorage()
    storage.write_new("memory://a/x", b"1")
    storage.write_new("memory://b/x", b"2")
    assert storage.read("memory://a/x") == b"1" and storage.read("memory://b/x") == b"2"
    storage.clear("a")
    assert not storage.exists("memory://a/x") and storage.exists("memory://b/x")


def test_directories_are_prefixes_of_objects() -> None:
    storage = MemoryStorage()
    storage.make_dirs("memory://t/run/empty")
    assert not storage.exists("memory://t/run/empty")  # nothing stored, nothing there
    storage.write_new("memory://t/run/step/manifest.json", b"{}")
    assert storage.is_dir("memory://t/run") and storage.is_dir("memory://t/run/step/")
    assert storage.list("memory://t//run") == ["step"]
    assert storage.parent("memory://t/run/step") == "memory://t/run"
    assert storage.free_bytes("memory://t/run") is None
    assert isinstance(storage.commit, ManifestLastCommit)


def test_an_object_appears_whole_when_its_writer_syncs() -> None:
    storage = MemoryStorage()
    writer = storage.create("memory://t/a")
    writer.write(b"half")
    assert storage.read("memory://t/a") == b""  # reserved, nothing published yet
    writer.write(b" and half")
    writer.sync()
    writer.close()
    assert storage.read("memory://t/a") == b"half and half"


def test_concurrent_exclusive_creates_have_one_winner() -> None:
    storage = MemoryStorage()
    wins, barrier = [], threading.Barrier(8)

    def race(n: int) -> None:
        barrier.wait()
        try:
            storage.write_new("memory://t/lock", str(n).encode())
            wins.append(n)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and storage.read("memory://t/lock") == str(wins[0]).encode()


def test_locations_must_name_a_store() -> None:
    storage = MemoryStorage()
    with pytest.raises(ValueError, match="name a store"):
        storage.write_new("memory://", b"")
    with pytest.raises(ValueError, match="not a memory:// location"):
        storage.read("/tmp/x")


def test_the_url_scheme_reaches_one_store_per_process() -> None:
    first = storage_for("memory://shared-test/x")
    second = storage_for("memory://other-test/y")
    assert first is second
