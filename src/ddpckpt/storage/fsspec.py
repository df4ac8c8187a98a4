"""Any fsspec file system as a ddpckpt storage (extra ``ddpckpt[fsspec]``): after
``ddpckpt.storage.fsspec.use("gs")`` every process serves ``gs://`` URLs through gcsfs, and
``use("team", fs=my_fs)`` serves ``team://...`` through a configured instance (the Object
storage page of the documentation shows it run).

A checkpoint commits with :class:`~ddpckpt.storage._commit.ManifestLastCommit`, as on S3: the
data objects are written under the checkpoint's prefix, the manifest last, and only a
prefix with a valid manifest is a checkpoint, so it needs no rename from the file system.
What it does need: ``pipe_file`` writes an object whole (one PUT on object stores; on a
local disk use plain paths, which ddpckpt writes with rename and fsync instead), and a
stream written with ``open(..., "wb")`` is complete once closed. A partly written data
object may be visible meanwhile on some file systems; no manifest lists it, so it is never
loaded. Exclusive creates are checked before writing (two jobs creating one object at the
same moment are not told apart). Retries, timeouts and credentials are the file system's
own (``storage_options=`` reaches ``fsspec.filesystem(protocol, **options)``).
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import errno
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

try:
    import fsspec
except ImportError as _missing:  # pragma: no cover - depends on the installation
    raise ImportError(
        "fsspec file systems need fsspec: pip install 'ddpckpt[fsspec]'"
    ) from _missing

from ddpckpt.storage import register
from ddpckpt.storage._base import Storage
from ddpckpt.storage._commit import ManifestLastCommit
from ddpckpt.storage._names import plain_name
from ddpckpt.storage._streams import RangedReader, Reader, Writer

__all__ = ["FsspecStorage", "use"]

_MiB = 1 << 20
_T = TypeVar("_T")


@contextlib.contextmanager
def _errors(location: str) -> Iterator[None]:
    """The file system's failures as :class:`OSError` (most already are), naming ``location``."""
    try:
        yield
    except OSError:
        raise
    except (ValueError, RuntimeError, KeyError) as exc:
        raise OSError(errno.EIO, f"{type(exc).__name__}: {exc}", location) from exc


class _FsspecWriter(Writer):
    """Streams into ``fs.open(path, "wb")``; ``sync`` closes (commits) it, ``close`` without
    ``sync`` discards what was written."""

    def __init__(self, storage: FsspecStorage, location: str) -> None:
        self._storage, self._location = storage, location
        with _errors(location):
            self._file: Any = storage.fs.open(storage.path(location), "wb")
        self._done = False

    def write(self, data: Any) -> None:
        if self._file is None:
            raise ValueError(f"{self._location}: write after close")
        with _errors(self._location):
            self._file.write(memoryview(data).cast("B"))

    def sync(self) -> None:
        if self._file is None:
            raise ValueError(f"{self._location}: sync after close")
        with _errors(self._location):
            self._file.close()
        self._done = True

    def close(self) -> None:
        file, self._file = self._file, None
        if file is None or self._done:
            return
        discard = getattr(file, "discard", None)
        with contextlib.suppress(Exception):  # the write's own error is being raised
            if discard is not None and not getattr(file, "autocommit", True):
                discard()
            else:
                file.close()
        with contextlib.suppress(OSError):  # no partial object left where one can be
            self._storage.delete(self._location)


class _FsspecReader(RangedReader):
    """A small object is read whole when opened (so it keeps those bytes); a larger one is
    read by ranges (``cat_file(path, start, end)``)."""

    def __init__(self, storage: FsspecStorage, location: str) -> None:
        self._storage, self._location = storage, location
        self.size = storage.size(location)
        self._data: bytes | None = None
        if self.size <= storage.small_object:
            self._data = storage.read(location)
            self.size = len(self._data)

    def _read_range(self, view: memoryview, offset: int) -> None:
        storage = self._storage
        with _errors(self._location):
            data = storage.fs.cat_file(storage.path(self._location), offset, offset + len(view))
        if len(data) != len(view):
            raise OSError(
                errno.EIO, f"short ranged read ({len(data)} of {len(view)} bytes)", self._location
            )
        view[:] = data


class FsspecStorage(Storage):
    """``scheme://path`` locations on the fsspec file system ``fs`` (the part after
    ``scheme://`` is the file system's path); usually made by :func:`use`.

    It commits with :class:`~ddpckpt.storage.ManifestLastCommit` (no rename needed). The
    file system's ``ValueError``, ``RuntimeError`` and ``KeyError`` are reported as
    :class:`OSError` (``EIO``, which a ``Checkpointer`` retries), naming the location.

    Args:
        fs: The fsspec file system, configured (credentials, endpoint).
        small_object: Objects up to this many bytes are read whole when opened.
    """

    commit = ManifestLastCommit()

    def __init__(self, fs: fsspec.AbstractFileSystem, *, small_object: int = 8 * _MiB) -> None:
        self.fs, self.small_object = fs, small_object

    def __repr__(self) -> str:  # the file system's options may hold credentials
        return f"FsspecStorage({type(self.fs).__name__})"

    def path(self, location: str) -> str:
        """The file system's path for ``location``."""
        scheme, sep, rest = location.partition("://")
        if not sep or not rest.strip("/"):
            raise ValueError(f"{location}: not a URL with a path, as in {scheme}://bucket/run")
        return str(self.fs._strip_protocol(rest))

    def _call(self, location: str, operation: Callable[..., _T], *args: Any) -> _T:
        with _errors(location):
            return operation(self.path(location), *args)

    # ---------------------------------------------------------------- objects
    def create(self, location: str) -> Writer:
        if self._call(location, self.fs.isfile):
            raise FileExistsError(errno.EEXIST, "object exists", location)
        return _FsspecWriter(self, location)

    def open(self, location: str) -> Reader:
        return _FsspecReader(self, location)

    def replace(self, location: str, data: bytes) -> None:
        self._call(location, self.fs.pipe_file, bytes(data))

    def read(self, location: str) -> bytes:
        return bytes(self._call(location, self.fs.cat_file))

    def size(self, location: str) -> int:
        if not self._call(location, self.fs.isfile):
            raise FileNotFoundError(errno.ENOENT, "no such object", location)
        return int(self._call(location, self.fs.size))

    def age(self, location: str) -> float:
        try:
            modified = self._call(location, self.fs.modified)
        except NotImplementedError:
            info = self._call(location, self.fs.info)
            modified = info.get("mtime") or info.get("LastModified") or info.get("created")
        if isinstance(modified, datetime.datetime):
            if modified.tzinfo is None:
                modified = modified.replace(tzinfo=datetime.timezone.utc)
            modified = modified.timestamp()
        return datetime.datetime.now(datetime.timezone.utc).timestamp() - float(modified)

    def touch(self, location: str) -> None:
        try:
            self._call(location, lambda path: self.fs.touch(path, truncate=False))
        except (NotImplementedError, OSError):  # object stores cannot touch: write it again
            self.replace(location, self.read(location))

    def delete(self, location: str) -> None:
        if not self._call(location, self.fs.isfile):
            raise FileNotFoundError(errno.ENOENT, "no such object", location)
        self._call(location, self.fs.rm_file)

    def copy(self, source: str, target: str) -> None:
        if self._call(target, self.fs.isfile):
            raise FileExistsError(errno.EEXIST, "object exists", target)
        self._call(source, self.fs.cp_file, self.path(target))

    # --------------------------------------------------------------- prefixes
    def is_dir(self, location: str) -> bool:
        return bool(self._call(location, self.fs.isdir))

    def exists(self, location: str) -> bool:
        return bool(self._call(location, self.fs.exists))

    def list(self, location: str) -> list[str]:
        if not self.is_dir(location):
            raise FileNotFoundError(errno.ENOENT, "no such directory", location)
        listed = self._call(location, lambda path: self.fs.ls(path, detail=True))
        return sorted(set(self._names(location, listed, one_level=True)))

    def walk(self, location: str) -> builtins.list[str]:
        if not self.is_dir(location):
            return []
        return sorted(self._names(location, self._call(location, self.fs.find), one_level=False))

    def _names(
        self, location: str, listed: Iterable[Any], *, one_level: bool
    ) -> builtins.list[str]:
        """The names under ``location`` of the paths the file system ``listed`` (paths, or
        ``ls``'s entries with their type), each exactly as listed: one with an empty, ``.``
        or ``..`` segment (an object store's key ``run//x`` or ``step-6/./manifest.json``),
        or outside ``location``, is skipped with a WARNING (:mod:`~ddpckpt.storage._names`),
        never re-split into another name; a directory is reported as the prefix of the
        paths under it."""
        root = self.path(location).rstrip("/") + "/"
        names = []
        for entry in listed:
            path = str(entry["name"] if isinstance(entry, dict) else entry)
            inside = path.startswith(root)
            name = path[len(root) :] if inside else ""
            if one_level and name.endswith("/"):  # a directory's own trailing slash
                name = name[:-1]
            directory = isinstance(entry, dict) and entry.get("type") == "directory"
            key = f"{root}{name}/" if directory and inside else path
            if plain_name(name, key, location, prefix=directory) is not None:
                names.append(name)
        return names

    def make_dirs(self, location: str) -> None:
        self._call(location, lambda path: self.fs.makedirs(path, exist_ok=True))

    def delete_tree(self, location: str) -> None:
        if self.exists(location):
            self._call(location, lambda path: self.fs.rm(path, recursive=True))

    def rename(self, source: str, target: str) -> None:
        """Move an object or a tree (a copy and a delete on object stores: not atomic; the
        commit never relies on it)."""
        if not self.exists(source):
            raise FileNotFoundError(errno.ENOENT, "no such object or directory", source)
        if self.is_dir(source) and self.walk(target):
            raise OSError(errno.ENOTEMPTY, "target exists", target)
        self._call(source, lambda path: self.fs.mv(path, self.path(target), recursive=True))

    # ---------------------------------------------------------------- the rest
    def parent(self, location: str) -> str:
        scheme, _, rest = location.partition("://")
        head = rest.rstrip("/").rpartition("/")[0]
        return f"{scheme}://{head}" if head else f"{scheme}://{rest.strip('/')}"

    def free_bytes(self, location: str) -> int | None:
        return None


_lock = threading.Lock()


def use(scheme: str, fs: fsspec.AbstractFileSystem | None = None, *, protocol: str = "") -> None:
    """Serve ``scheme://`` URLs through fsspec; local: call it in every process, before
    the first save or load of such a URL (it :func:`~ddpckpt.storage.register`-s the
    scheme, replacing what served it).

    Args:
        scheme: The URL scheme, without ``://`` (``"gs"``).
        fs: A configured file system to serve every such URL; without it,
            ``fsspec.filesystem(protocol or scheme)`` is made on first use (credentials
            and endpoint from that file system's usual places). ``storage_options=``
            (``save``, ``load``, ``Checkpointer``) make
            ``fsspec.filesystem(protocol or scheme, **options)`` instead.
        protocol: The fsspec protocol, where it differs from ``scheme``.

    Nothing is checked until the first URL is resolved: then fsspec's own errors (an
    unknown protocol, its implementation such as gcsfs not installed) reach the caller.
    """
    made: list[FsspecStorage] = [FsspecStorage(fs)] if fs is not None else []
    name = protocol or scheme

    def factory(url: str) -> Storage:
        with _lock:
            if not made:
                made.append(FsspecStorage(fsspec.filesystem(name)))
            return made[0]

    def configured(options: Mapping[str, Any]) -> Storage:
        return FsspecStorage(fsspec.filesystem(name, **options))

    register(scheme, factory, configured=configured)
