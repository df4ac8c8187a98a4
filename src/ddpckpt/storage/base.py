"""How bytes are stored: the :class:`Storage` interface and the commit strategies.

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
import dataclasses
import errno
import json
import uuid
from types import TracebackType
from typing import Any

from ddpckpt._log import get_logger

__all__ = [
    "CommitStrategy",
    "ManifestLastCommit",
    "RangedReader",
    "Reader",
    "RenameCommit",
    "Storage",
    "Writer",
    "is_temp_name",
    "new_token",
    "temp_name",
]

MANIFEST = "manifest.json"  # the commit marker both strategies rely on
_TEMP_MARK = ".tmp-"
_log = get_logger(__name__)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_name(location: str, token: str) -> str:
    """A temporary sibling of ``location``: ``dir/.name.tmp-<token>``."""
    head, slash, name = location.rstrip("/").rpartition("/")
    return f"{head}{slash}.{name}{_TEMP_MARK}{token}"


def is_temp_name(name: str) -> bool:
    """True for names of temporary (uncommitted) directories and files this library makes."""
    return name.startswith(".") and _TEMP_MARK in name


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
        """Open an object for ranged reads."""

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
            buffer = bytearray(reader.size)
            view, done = memoryview(buffer), 0
            while done < len(buffer):
                count = reader.read_into(view[done:], done)
                if count == 0:
                    break
                done += count
            return bytes(buffer[:done])
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


class CommitStrategy(abc.ABC):
    """How a checkpoint at location ``final`` becomes visible, all at once.

    The leader of each storage domain calls :meth:`begin` before any rank writes, every
    rank then writes its objects under :meth:`staging`, the leader writes the manifest
    there last, then calls :meth:`publish`; on failure it calls :meth:`abort`.
    """

    @abc.abstractmethod
    def staging(self, storage: Storage, final: str, token: str, *, overwrite: bool = False) -> str:
        """Where the objects of the checkpoint ``final`` are written before publishing
        (``overwrite``: the save may replace a committed checkpoint there)."""

    @abc.abstractmethod
    def exists(self, storage: Storage, final: str) -> bool:
        """Whether a save to ``final`` without ``overwrite`` must be refused."""

    @abc.abstractmethod
    def begin(self, storage: Storage, final: str, staging: str, *, overwrite: bool) -> None:
        """Prepare ``staging`` for the writers."""

    @abc.abstractmethod
    def publish(self, storage: Storage, staging: str, final: str, *, overwrite: bool) -> None:
        """Make the finished checkpoint visible at ``final`` (its manifest is written).
        Raises ``FileExistsError`` if ``final`` exists and ``overwrite`` is false."""

    def abort(self, storage: Storage, staging: str, final: str) -> None:
        """Remove what a failed save left; never a committed checkpoint. Called while the
        save's own error propagates, so a storage failure here (the store that just failed
        the save is often still down) is logged, not raised: the leftovers are no
        checkpoint, and the next save there or ``ddpckpt clean`` removes them."""
        try:
            self._remove_leftovers(storage, staging, final)
        except OSError as exc:
            _log.warning(
                "%s: could not remove what the failed save left (%s); it is no checkpoint, "
                "and the next save there or `ddpckpt clean` removes it",
                staging,
                exc,
            )

    @abc.abstractmethod
    def _remove_leftovers(self, storage: Storage, staging: str, final: str) -> None:
        """What :meth:`abort` does."""

    @abc.abstractmethod
    def discard(self, storage: Storage, final: str) -> None:
        """Delete a committed checkpoint so that a crash midway never leaves a damaged one
        that still looks committed."""

    @abc.abstractmethod
    def set_aside(self, storage: Storage, final: str, target: str) -> None:
        """Move a (broken) checkpoint to ``target``, where it is never loaded."""

    def unfinished(self, storage: Storage, final: str) -> list[str]:
        """What interrupted saves left inside the committed checkpoint ``final``: no part of
        it, safe to delete once no save to ``final`` is in flight."""
        return []


class RenameCommit(CommitStrategy):
    """Write into a temporary sibling ``.D.tmp-<token>``, manifest last, sync, then rename
    it to ``D``: readers see no ``D`` or a complete one; a crash leaves only a temporary,
    which :func:`is_temp_name` recognises. Overwriting exchanges the two directories where
    the store can (``renameat2`` on Linux); elsewhere the old one is renamed aside first."""

    def staging(self, storage: Storage, final: str, token: str, *, overwrite: bool = False) -> str:
        return temp_name(final, token)

    def exists(self, storage: Storage, final: str) -> bool:
        return storage.exists(final)

    def begin(self, storage: Storage, final: str, staging: str, *, overwrite: bool) -> None:
        storage.make_dirs(staging)

    def publish(self, storage: Storage, staging: str, final: str, *, overwrite: bool) -> None:
        storage.sync_dir(staging)
        old: str | None = None
        if not storage.exists(final):
            storage.rename(staging, final)  # ENOTEMPTY/EEXIST if another process won a race
        elif not overwrite:
            raise FileExistsError(errno.EEXIST, "checkpoint already exists", final)
        elif self._exchange(storage, staging, final):
            old = staging  # now holds the previous checkpoint
        else:
            old = self.staging(storage, final, new_token())
            storage.rename(final, old)
            storage.rename(staging, final)
        storage.sync_dir(storage.parent(final))
        if old is not None:
            storage.delete_tree(old)

    def _exchange(self, storage: Storage, a: str, b: str) -> bool:
        exchange = getattr(storage, "exchange", None)
        return bool(exchange is not None and exchange(a, b))

    def _remove_leftovers(self, storage: Storage, staging: str, final: str) -> None:
        storage.delete_tree(staging)

    def discard(self, storage: Storage, final: str) -> None:
        doomed = self.staging(storage, final, new_token())
        storage.rename(final, doomed)
        storage.sync_dir(storage.parent(final))
        storage.delete_tree(doomed)

    def set_aside(self, storage: Storage, final: str, target: str) -> None:
        storage.rename(final, target)


class ManifestLastCommit(CommitStrategy):
    """For stores without rename: data objects are written under ``D`` itself and the
    manifest, written last, is the commit. A prefix without a valid manifest is never a
    checkpoint. Deleting removes the manifest first.

    Overwriting never leaves a moment without a committed checkpoint at ``D``: the new one
    is written under ``D/.next-<token>/``, manifest last; the commit replaces ``D``'s
    manifest in one write with that manifest, its object names prefixed by
    ``.next-<token>/``; only then are the old objects deleted. A failure before that write
    leaves the old checkpoint (and removes the new objects); one after it, the new one.
    """

    def staging(self, storage: Storage, final: str, token: str, *, overwrite: bool = False) -> str:
        return f"{final}/{_NEXT_MARK}{token}" if overwrite else final

    def exists(self, storage: Storage, final: str) -> bool:
        return storage.exists(f"{final}/{MANIFEST}")

    def begin(self, storage: Storage, final: str, staging: str, *, overwrite: bool) -> None:
        if self.exists(storage, final):
            if not overwrite:
                raise FileExistsError(errno.EEXIST, "checkpoint already exists", final)
            if staging != final:
                storage.make_dirs(staging)  # the old checkpoint stays committed meanwhile
                return
            self.discard(storage, final)
        storage.delete_tree(final)  # an interrupted save's leftovers: no checkpoint
        storage.make_dirs(staging)

    def publish(self, storage: Storage, staging: str, final: str, *, overwrite: bool) -> None:
        """Nothing left to do for a new checkpoint: the manifest the leader wrote last is
        the commit. For a replacement, the switch of manifests described above."""
        if staging == final:
            return
        prefix = staging[len(final) + 1 :]
        manifest = _relocated(storage.read(f"{staging}/{MANIFEST}"), prefix, final)
        storage.replace(f"{final}/{MANIFEST}", manifest)
        try:  # committed: what follows only frees space
            keep = {MANIFEST, *_listed(manifest)}
            for name in storage.walk(final):
                if name not in keep:
                    storage.delete(f"{final}/{name}")
        except OSError as exc:
            _log.warning(
                "%s: replaced, but deleting the objects of the previous save failed (%s); "
                "they are no part of the checkpoint and go when it is deleted or replaced",
                final,
                exc,
            )

    def _remove_leftovers(self, storage: Storage, staging: str, final: str) -> None:
        if staging != final:
            if staging[len(final) + 1 :] not in _committed_prefixes(
                storage, final
            ):  # not committed
                storage.delete_tree(staging)
        elif not self.exists(storage, final):
            storage.delete_tree(final)

    def discard(self, storage: Storage, final: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            storage.delete(f"{final}/{MANIFEST}")
        storage.delete_tree(final)

    def unfinished(self, storage: Storage, final: str) -> list[str]:
        """The ``.next-<token>/`` prefixes of overwrites that never switched the manifest
        (the process died first); the one the committed manifest names is the checkpoint."""
        try:  # listed before the manifest is read, so that a commit meanwhile is seen
            names = storage.list(final)
            committed = _prefixes(_listed(storage.read(f"{final}/{MANIFEST}")))
        except FileNotFoundError:
            return []  # no checkpoint: the whole prefix is an interrupted save's leftover
        return [
            f"{final}/{name}"
            for name in names
            if name.startswith(_NEXT_MARK) and name not in committed
        ]

    def set_aside(self, storage: Storage, final: str, target: str) -> None:
        names = storage.walk(final)
        for name in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
            storage.make_dirs(storage.parent(f"{target}/{name}"))
            storage.copy(f"{final}/{name}", f"{target}/{name}")
        self.discard(storage, final)


_NEXT_MARK = ".next-"


def _listed(manifest: bytes) -> list[str]:
    """The object names a manifest lists (read without verifying: a cleanup's question)."""
    try:
        return list(json.loads(manifest)["files"])
    except (ValueError, KeyError, TypeError):
        return []


def _committed_prefixes(storage: Storage, final: str) -> set[str]:
    """The first components of the names the committed manifest at ``final`` lists."""
    try:
        return _prefixes(_listed(storage.read(f"{final}/{MANIFEST}")))
    except FileNotFoundError:
        return set()


def _prefixes(names: list[str]) -> set[str]:
    return {name.split("/", 1)[0] for name in names if "/" in name}


def _relocated(manifest: bytes, prefix: str, where: str) -> bytes:
    """``manifest`` with every object name under ``prefix/``: what a replacement written
    under ``D/prefix`` commits as ``D``'s manifest."""
    from ddpckpt.format.manifest import Manifest  # the format builds on storage, not back

    parsed = Manifest.from_json(manifest, where)
    parsed.files = {
        f"{prefix}/{name}": dataclasses.replace(entry, name=f"{prefix}/{name}")
        for name, entry in parsed.files.items()
    }
    parsed.tensors = {
        key: dataclasses.replace(entry, file=f"{prefix}/{entry.file}")
        for key, entry in parsed.tensors.items()
    }
    return parsed.to_json().encode()
