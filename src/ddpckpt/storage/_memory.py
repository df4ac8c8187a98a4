"""An in-memory object store: ``memory://<name>/<key>``, one per process.

It behaves like an object store, not a file system: objects are whole byte strings
published when their writer syncs, directories are only prefixes of object keys (a
directory exists while it holds an object), and a checkpoint commits with
:class:`~ddpckpt.storage._commit.ManifestLastCommit`. It serves tests and experiments: the
save/load/resume suite runs on it to keep the storage seam honest, and code meant for
object storage can be tried without a server. Nothing survives the process; other
processes (other ranks) see nothing of it. Thread-safe.
"""

from __future__ import annotations

import builtins
import errno
import threading
import time
from typing import Any

from ddpckpt.storage._base import Storage
from ddpckpt.storage._commit import ManifestLastCommit
from ddpckpt.storage._streams import Reader, Writer

SCHEME = "memory://"


class _Object:
    __slots__ = ("data", "written")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.written = time.time()


class _MemoryWriter(Writer):
    def __init__(self, store: MemoryStorage, key: str) -> None:
        self._store, self._key = store, key
        self._buffer: bytearray | None = bytearray()

    def write(self, data: Any) -> None:
        assert self._buffer is not None, "write after close"
        self._buffer += memoryview(data).cast("B")

    def sync(self) -> None:
        assert self._buffer is not None, "sync after close"
        with self._store._lock:
            self._store._objects[self._key] = _Object(bytes(self._buffer))

    def close(self) -> None:
        self._buffer = None


class _MemoryReader(Reader):
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size = len(data)

    def read_into(self, view: memoryview, offset: int) -> int:
        piece = self._data[offset : offset + len(view)]
        view[: len(piece)] = piece
        return len(piece)

    def map(self) -> Any:
        return bytearray(self._data) if self._data else None

    def close(self) -> None:
        """Nothing to release: the bytes are immutable."""


class MemoryStorage(Storage):
    """All ``memory://`` locations of this process (every name is its own bucket)."""

    commit = ManifestLastCommit()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, _Object] = {}

    @staticmethod
    def _key(location: str) -> str:
        if not location.startswith(SCHEME):
            raise ValueError(f"{location}: not a {SCHEME} location")
        parts = [p for p in location[len(SCHEME) :].split("/") if p not in ("", ".")]
        if not parts:
            raise ValueError(f"{location}: name a store, as in {SCHEME}NAME/path")
        return "/".join(parts)

    def _get(self, location: str) -> _Object:
        with self._lock:
            found = self._objects.get(self._key(location))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", location)
        return found

    def _children(self, key: str) -> list[str]:
        prefix = key + "/"
        with self._lock:
            return [k[len(prefix) :] for k in self._objects if k.startswith(prefix)]

    def create(self, location: str) -> Writer:
        key = self._key(location)
        with self._lock:
            if key in self._objects:
                raise FileExistsError(errno.EEXIST, "object exists", location)
            self._objects[key] = _Object(b"")  # reserved: a second create conflicts
        return _MemoryWriter(self, key)

    def open(self, location: str) -> Reader:
        return _MemoryReader(self._get(location).data)

    def replace(self, location: str, data: bytes) -> None:
        with self._lock:
            self._objects[self._key(location)] = _Object(bytes(data))

    def read(self, location: str) -> bytes:
        return self._get(location).data

    def size(self, location: str) -> int:
        return len(self._get(location).data)

    def age(self, location: str) -> float:
        return time.time() - self._get(location).written

    def touch(self, location: str) -> None:
        self._get(location).written = time.time()

    def delete(self, location: str) -> None:
        key = self._key(location)
        with self._lock:
            if self._objects.pop(key, None) is None:
                raise FileNotFoundError(errno.ENOENT, "no such object", location)

    def is_dir(self, location: str) -> bool:
        return bool(self._children(self._key(location)))

    def exists(self, location: str) -> bool:
        key = self._key(location)
        with self._lock:
            if key in self._objects:
                return True
        return self.is_dir(location)

    def list(self, location: str) -> list[str]:
        names = {child.split("/", 1)[0] for child in self._children(self._key(location))}
        if not names:
            raise FileNotFoundError(errno.ENOENT, "no such directory", location)
        return sorted(names)

    def walk(self, location: str) -> builtins.list[str]:
        return sorted(self._children(self._key(location)))

    def make_dirs(self, location: str) -> None:
        self._key(location)  # prefixes need not be made; the location must be valid

    def delete_tree(self, location: str) -> None:
        key = self._key(location)
        prefix = key + "/"
        with self._lock:
            for doomed in [k for k in self._objects if k == key or k.startswith(prefix)]:
                del self._objects[doomed]

    def rename(self, source: str, target: str) -> None:
        old, new = self._key(source), self._key(target)
        with self._lock:
            moving = {k: v for k, v in self._objects.items() if k == old or k.startswith(old + "/")}
            if not moving:
                raise FileNotFoundError(errno.ENOENT, "no such object or directory", source)
            replacing = old in moving and new in self._objects  # an object over an object
            if not replacing and any(k == new or k.startswith(new + "/") for k in self._objects):
                raise FileExistsError(errno.EEXIST, "target exists", target)
            for k, v in moving.items():
                del self._objects[k]
                self._objects[new + k[len(old) :]] = v

    def parent(self, location: str) -> str:
        key = self._key(location)
        return SCHEME + key.rpartition("/")[0] if "/" in key else SCHEME + key

    def free_bytes(self, location: str) -> int | None:
        return None

    def clear(self, name: str | None = None) -> None:
        """Forget every object (of the store ``name`` only, if given)."""
        with self._lock:
            if name is None:
                self._objects.clear()
            else:
                for key in [k for k in self._objects if k.split("/", 1)[0] == name]:
                    del self._objects[key]
