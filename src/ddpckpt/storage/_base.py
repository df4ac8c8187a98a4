"""How bytes are stored: the :class:`Storage` interface (the commit strategies are in
:mod:`ddpckpt.storage._commit`).

A storage is addressed by *locations*: strings that name an object (a file) or a prefix
(a directory) in that storage's own spelling, e.g. ``/data/run/step-00000100/manifest.json``
on a file system or ``memory://t/run/step-00000100/manifest.json`` in memory. Locations are
joined with ``/`` (``os.path.join`` on POSIX); :func:`ddpckpt.storage.resolve` maps a path or
URL to the storage that serves it.

Nothing here knows about ranks. The callers decide who calls what: every rank creates,
writes and syncs the data objects it was assigned and reads the ones it loads; one rank
per storage domain (the leader) runs the commit strategy's ``begin``/``publish``/``abort``,
writes the manifest and ``latest``, applies retention and holds the run's lock.

What is atomic: :meth:`Storage.create` is exclusive (a second create of the same location
raises :class:`FileExistsError`); :meth:`Storage.replace` swaps a small object so that
readers see the old or the new content; a checkpoint becomes visible all at once through
its :class:`CommitStrategy`. Everything else (listing, deleting a tree) is not atomic.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ddpckpt._log import get_logger

if TYPE_CHECKING:
    from ddpckpt.storage._commit import CommitStrategy

MANIFEST = "manifest.json"  # the commit marker both strategies rely on
_TEMP_MARK = ".tmp-"
_PREVIOUS_MARK = ".previous"
_log = get_logger(__name__)


class NotRegularFileError(OSError):
    """The object at a location is no regular file (a symbolic link, a FIFO, a device ...):
    storages open only regular files, so that reading never blocks on a FIFO, never reads
    a device without end and never follows a link out of a checkpoint."""

    def __init__(self, location: str, kind: str) -> None:
        code = errno.EISDIR if kind == "a directory" else errno.EINVAL
        what = os.strerror(code) if code == errno.EISDIR else f"{kind}, not a regular file"
        super().__init__(code, what, location)
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class BucketNotFoundError(FileNotFoundError):
    """The bucket a location names does not exist: unlike a missing directory, no run can be
    started there, so callers that take "not found" for "nothing saved yet" must not."""


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_name(location: str, token: str) -> str:
    """A temporary sibling of ``location``: ``dir/.name.tmp-<token>``."""
    head, slash, name = location.rstrip("/").rpartition("/")
    return f"{head}{slash}.{name}{_TEMP_MARK}{token}"


def is_temp_name(name: str) -> bool:
    """True for names of temporary (uncommitted) directories and files this library makes."""
    return name.startswith(".") and _TEMP_MARK in name


def previous_name(location: str) -> str:
    """Where an overwrite without an atomic exchange keeps the committed checkpoint it
    replaces until the new one is durable: ``dir/.name.previous``. No temporary: that
    copy *is* the checkpoint ``name`` while ``name`` is missing."""
    head, slash, name = location.rstrip("/").rpartition("/")
    return f"{head}{slash}.{name}{_PREVIOUS_MARK}"


def previous_of(name: str) -> str | None:
    """The checkpoint name whose replaced copy ``name`` is (see :func:`previous_name`)."""
    if name.startswith(".") and name.endswith(_PREVIOUS_MARK) and not is_temp_name(name):
        return name[1 : -len(_PREVIOUS_MARK)] or None
    return None


class Writer(abc.ABC):
    """A new object being written as a stream. ``sync`` makes it complete and durable;
    ``close`` without ``sync`` leaves at most a partial object that no manifest lists."""

    @abc.abstractmethod
    def write(self, data: Any) -> None:
        """Append all of ``data``."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make everything written durable (fsync; the end of an upload)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object's resources; idempotent."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Reader(abc.ABC):
    """An object opened for reading: the bytes at the moment it was opened, even if the
    location is replaced or deleted meanwhile."""

    size: int

    @abc.abstractmethod
    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill a prefix of ``view`` with the bytes at ``offset``; the count (0 past the end)."""

    @abc.abstractmethod
    def map(self) -> Any:
        """The whole object as a writable buffer private to this reader (a copy-on-write
        memory map on POSIX), or ``None`` when it is empty."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object; buffers from :meth:`map` stay valid."""

    def read_all(self) -> bytes:
        """All ``size`` bytes (fewer if the object shrank since it was opened)."""
        buffer = bytearray(self.size)
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            count = self.read_into(view[done:], done)
            if count == 0:
                break
            done += count
        return bytes(buffer[:done])


class RangedReader(Reader):
    """A reader for object stores: a small object's bytes kept from when it was opened
    (``_data``), a larger one's read by ranges (:meth:`_read_range`)."""

    _data: bytes | None = None

    @abc.abstractmethod
    def _read_range(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` with the stored bytes at ``offset``."""

    def read_into(self, view: memoryview, offset: int) -> int:
        count = max(0, min(len(view), self.size - offset))
        if count == 0:
            return 0
        if self._data is not None:
            view[:count] = self._data[offset : offset + count]
        else:
            self._read_range(view[:count], offset)
        return count

    def map(self) -> Any:
        if self.size == 0:
            return None
        buffer = bytearray(self.size)
        self.read_into(memoryview(buffer), 0)
        return buffer

    def close(self) -> None:
        self._data = None


class Storage(abc.ABC):
    """The operations ddpckpt performs on stored bytes; see the module for locations,
    ranks and atomicity. Missing objects raise :class:`FileNotFoundError`."""

    #: How a checkpoint is made visible here (a directory rename, or the manifest last).
    commit: CommitStrategy

    # ------------------------------------------------------------------- objects
    @abc.abstractmethod
    def create(self, location: str) -> Writer:
        """A writer for a new object; :class:`FileExistsError` if ``location`` exists."""

    @abc.abstractmethod
    def open(self, location: str) -> Reader:
        """Open an object for ranged reads: a regular object only (never a link, FIFO or
        device: :class:`NotRegularFileError`), without blocking."""

    @abc.abstractmethod
    def replace(self, location: str, data: bytes) -> None:
        """Write a small object atomically and durably, replacing any previous one."""

    @abc.abstractmethod
    def size(self, location: str) -> int:
        """Bytes of the object at ``location``."""

    @abc.abstractmethod
    def age(self, location: str) -> float:
        """Seconds since the object was last written or touched."""

    @abc.abstractmethod
    def touch(self, location: str) -> None:
        """Mark the object as written now (its content unchanged)."""

    @abc.abstractmethod
    def delete(self, location: str) -> None:
        """Delete one object."""

    def write_new(self, location: str, data: bytes) -> None:
        """Create ``location`` (which must not exist) holding ``data``, durably."""
        with self.create(location) as writer:
            writer.write(data)
            writer.sync()

    def read(self, location: str) -> bytes:
        """The whole (small) object at ``location``."""
        reader = self.open(location)
        try:
            return reader.read_all()
        finally:
            reader.close()

    def copy(self, source: str, target: str) -> None:
        """Copy one object to a new location (a server-side copy where the store has one)."""
        self.write_new(target, self.read(source))

    # ------------------------------------------------------------------ prefixes
    @abc.abstractmethod
    def is_dir(self, location: str) -> bool:
        """Whether ``location`` is a directory (a prefix holding objects, on object stores)."""

    @abc.abstractmethod
    def exists(self, location: str) -> bool:
        """Whether ``location`` is an object or a directory."""

    @abc.abstractmethod
    def list(self, location: str) -> list[str]:
        """Names directly under the directory ``location``; :class:`FileNotFoundError` if none."""

    @abc.abstractmethod
    def walk(self, location: str) -> list[str]:
        """Every object under ``location``, relative to it (``a/b``); empty if none."""

    @abc.abstractmethod
    def make_dirs(self, location: str) -> None:
        """Make the directory ``location`` and its parents where the store has directories."""

    @abc.abstractmethod
    def delete_tree(self, location: str) -> None:
        """Delete a directory (or object) and everything under it; missing is fine."""

    @abc.abstractmethod
    def rename(self, source: str, target: str) -> None:
        """Move an object or a directory; atomic where :attr:`commit` is a
        :class:`RenameCommit`. An object replaces an object at ``target``; a directory
        meeting an existing non-empty ``target`` raises :class:`OSError` (``EEXIST`` or
        ``ENOTEMPTY``)."""

    # ---------------------------------------------------------------- the rest
    @abc.abstractmethod
    def parent(self, location: str) -> str:
        """The directory holding ``location`` (absolute where the store has a working
        directory)."""

    @abc.abstractmethod
    def free_bytes(self, location: str) -> int | None:
        """Bytes free for new objects at ``location``; ``None`` where unbounded/unknown."""

    def best_effort(self) -> Storage:
        """This storage for a last operation that must not hold the process up (at
        interpreter exit): each request is tried once, with short timeouts. Local stores
        have no retries and return themselves."""
        return self

    def sync_dir(self, location: str) -> None:  # noqa: B027 - a no-op unless overridden
        """Make the entries of the directory ``location`` durable (POSIX only)."""

    def tree_bytes(self, location: str) -> int:
        """Bytes under ``location`` (an object or a directory); vanishing objects count 0."""
        names = self.walk(location) if self.is_dir(location) else [""]
        total = 0
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += self.size(f"{location}/{name}" if name else location)
        return total
