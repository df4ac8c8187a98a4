"""A local (or network-mounted POSIX) file system: the only module that calls the OS file API.

Locations are ordinary paths. Objects are created with ``O_EXCL`` and fsynced; streamed
writes hand finished pages to the disk early (``posix_fadvise``) so the final fsync waits
for less; reads are ``preadv`` into the caller's buffer or a copy-on-write ``mmap``, of
regular files only: a symbolic link, FIFO or device at a location raises
:class:`~ddpckpt.storage._errors.NotRegularFileError` without blocking or following it.
Checkpoints commit with :class:`~ddpckpt.storage._commit.RenameCommit`: a temporary sibling
directory, fsynced, renamed into place (exchanged atomically with an old one through Linux
``renameat2`` when overwriting), and the parent directory fsynced.

Where ``renameat2(RENAME_EXCHANGE)`` is unsupported (NFS, Lustre, macOS, many FUSE file
systems) an overwrite takes two renames instead. ``PosixStorage(rename_exchange=False)``, or
``DDPCKPT_RENAME_EXCHANGE=0`` in the environment for the default instance, takes that path on
any file system: for testing it, or for a file system whose exchange cannot be trusted.

Files are created ``0644`` and directories ``0777``, less the process's umask (usually
``0755``), as ``open`` and ``mkdir`` do: a run directory is as private as the directory
the user puts it in. Under a directory made with :meth:`PosixStorage.make_private_dir`
(a fast tier, in a tmpfs other users share), files are created ``0600`` and directories
``0700``.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import functools
import mmap
import os
import pwd
import shutil
import stat
import threading
import time
from typing import Any

from ddpckpt._log import get_logger
from ddpckpt.storage._base import Storage
from ddpckpt.storage._commit import RenameCommit
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._layout import new_token, temp_name
from ddpckpt.storage._streams import Reader, Writer

_log = get_logger(__name__)
_WRITEBACK_BYTES = 32 << 20  # start the disk writing after this many new bytes
_FILE_MODE, _DIR_MODE = 0o644, 0o777  # less the umask, as open() and mkdir() default to
_PRIVATE_FILE_MODE, _PRIVATE_DIR_MODE = 0o600, 0o700
_private_roots: tuple[str, ...] = ()  # made by make_private_dir; replaced, never mutated
_private_lock = threading.Lock()


def _is_private(location: str) -> bool:
    """Whether ``location`` lies under a directory made with ``make_private_dir``."""
    roots = _private_roots
    if not roots:
        return False
    absolute = os.path.abspath(location)
    return any(absolute == root or absolute.startswith(root + os.sep) for root in roots)


def _create_file(path: str) -> int:
    """A new file at ``path`` (``O_EXCL``), open for writing, with the mode its place calls
    for (see the module docstring)."""
    mode = _PRIVATE_FILE_MODE if _is_private(path) else _FILE_MODE
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)


def _user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class _FileWriter(Writer):
    def __init__(self, path: str) -> None:
        self._fd: int | None = _create_file(path)
        self._written = self._flushed = 0

    def write(self, data: Any) -> None:
        fd = self._fd
        assert fd is not None, "write after close"
        view = memoryview(data).cast("B")
        while view:
            count = os.write(fd, view)
            view, self._written = view[count:], self._written + count
        if self._written - self._flushed >= _WRITEBACK_BYTES:
            self._start_writeback(fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written

    @staticmethod
    def _start_writeback(fd: int, offset: int, length: int) -> None:
        # Hands the pages written so far to the disk now, so it writes while we copy and
        # hash the rest and the final fsync waits for less (measured 1.2-1.4x faster to
        # durable here). DONTNEED drops only pages already clean: a checkpoint does not
        # crowd the training's page cache.
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # only a hint: fsync still makes it durable
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def sync(self) -> None:
        assert self._fd is not None, "sync after close"
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


# Opening never blocks (a FIFO with no writer) and never follows a link in the last component;
# what was opened is checked with fstat, so a file swapped in between cannot slip through.
_OPEN_FLAGS = (
    os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, *, follow_links: bool = False) -> int:
    """A read-only descriptor of the regular file at ``path``; :class:`NotRegularFileError`
    for anything else (checked before opening, so no device is opened, and after, on the
    descriptor itself). ``follow_links`` opens the file a symbolic link names (a path the
    user gave, such as a downloaded model in a cache of links)."""
    with contextlib.suppress(FileNotFoundError):  # a missing file: open says so below
        mode = (os.stat if follow_links else os.lstat)(path).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, _kind(mode))
    flags = _OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0) if follow_links else _OPEN_FLAGS
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link swapped in after lstat
            raise NotRegularFileError(path, "a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, _kind(mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


class _FileReader(Reader):
    _fd: int | None = None

    def __init__(self, path: str) -> None:
        fd = open_regular(path)
        try:
            self.size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        # Kept open, so reads see the very file that was opened even if the path is
        # replaced meanwhile.
        self._fd = fd

    def read_into(self, view: memoryview, offset: int) -> int:
        assert self._fd is not None, "read after close"
        return os.preadv(self._fd, [view], offset)

    def map(self) -> Any:
        assert self._fd is not None, "map after close"
        # Plain faults with kernel readahead: measured 2.3x faster here than MAP_POPULATE.
        return mmap.mmap(self._fd, self.size, access=mmap.ACCESS_COPY) if self.size else None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class PosixStorage(Storage):
    """Files and directories through the OS; see the module docstring.

    ``rename_exchange``: whether overwrites may use ``renameat2(RENAME_EXCHANGE)``; ``None``
    reads ``DDPCKPT_RENAME_EXCHANGE`` at each overwrite (``0`` turns it off).
    """

    commit = RenameCommit()

    def __init__(self, rename_exchange: bool | None = None) -> None:
        self.rename_exchange = rename_exchange

    def create(self, location: str) -> Writer:
        return _FileWriter(location)

    def open(self, location: str) -> Reader:
        return _FileReader(location)

    def replace(self, location: str, data: bytes) -> None:
        parent = self.parent(location)
        tmp = temp_name(os.path.join(parent, os.path.basename(location)), new_token())
        try:
            self.write_new(tmp, data)
            os.replace(tmp, location)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.sync_dir(parent)

    def read(self, location: str) -> bytes:
        with os.fdopen(open_regular(location), "rb") as f:
            return f.read()

    def size(self, location: str) -> int:
        return os.stat(location).st_size

    def age(self, location: str) -> float:
        return time.time() - os.stat(location).st_mtime

    def touch(self, location: str) -> None:
        os.utime(location)

    def delete(self, location: str) -> None:
        os.unlink(location)

    def copy(self, source: str, target: str) -> None:
        with (
            os.fdopen(open_regular(source), "rb") as src,
            os.fdopen(_create_file(target), "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 16 << 20)
            dst.flush()
            os.fsync(dst.fileno())

    def is_dir(self, location: str) -> bool:
        return os.path.isdir(location)

    def exists(self, location: str) -> bool:
        return os.path.lexists(location)

    def list(self, location: str) -> list[str]:
        return os.listdir(location)

    def walk(self, location: str) -> builtins.list[str]:
        found = []
        for root, _, files in os.walk(location):
            rel = os.path.relpath(root, location)
            found += [name if rel == "." else os.path.join(rel, name) for name in files]
        return found

    def make_dirs(self, location: str) -> None:
        mode = _PRIVATE_DIR_MODE if _is_private(location) else _DIR_MODE
        os.makedirs(location, mode, exist_ok=True)

    def make_private_dir(self, location: str) -> str | None:
        """Make ``location`` a directory that only this process's user may use, and create
        what is made beneath it from now on private too (files ``0600``, directories
        ``0700``, in this process). Returns ``None``, or why it may not be used: it exists
        and is a symbolic link (even to a good directory), no directory, owned by another
        user, or writable by its group or others; nothing is then read from it or written
        through it. A directory of this user that others may only read or enter is made
        ``0700`` (logged). Missing parents are created as :meth:`make_dirs` does.

        The directory is checked on a descriptor opened without following a link, so a
        link swapped in after a look cannot pass; and every directory above it (as named,
        and with links resolved) must be root's or this user's, and sticky where others may
        write in it (as ``/dev/shm`` and ``/tmp`` are), so that no other user can rename it
        away and put another in its place.
        """
        global _private_roots
        absolute = os.path.abspath(location)
        os.makedirs(os.path.dirname(absolute), exist_ok=True)
        problem = _unsafe_ancestor(absolute)
        if problem is not None:
            return problem
        with contextlib.suppress(FileExistsError):
            os.mkdir(absolute, _PRIVATE_DIR_MODE)
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(absolute, flags | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            return _not_a_directory(absolute)
        try:
            found = os.fstat(fd)
            if not stat.S_ISDIR(found.st_mode):  # O_NOFOLLOW|O_DIRECTORY where unsupported
                return _not_a_directory(absolute)
            mode = stat.S_IMODE(found.st_mode)
            if found.st_uid != os.geteuid():
                return (
                    f"it is owned by {_user(found.st_uid)}, not by this job's user "
                    f"{_user(os.geteuid())}"
                )
            if mode & 0o022:
                return f"its group or other users may write in it (mode {mode:04o})"
            if mode != _PRIVATE_DIR_MODE:
                os.fchmod(fd, _PRIVATE_DIR_MODE)
                _log.info("%s: made private (mode %04o, was %04o)", absolute, 0o700, mode)
        finally:
            os.close(fd)
        with _private_lock:
            roots = {absolute, os.path.realpath(absolute), *_private_roots}
            _private_roots = tuple(sorted(roots))
        return None

    def delete_tree(self, location: str) -> None:
        if os.path.isdir(location) and not os.path.islink(location):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(location)
        elif os.path.lexists(location):  # on a read-only file system unlink says EROFS, not ENOENT
            with contextlib.suppress(FileNotFoundError):
                os.unlink(location)

    def rename(self, source: str, target: str) -> None:
        os.rename(source, target)

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); False where unsupported
        or turned off (see the class)."""
        enabled = self.rename_exchange
        if enabled is None:
            enabled = os.environ.get("DDPCKPT_RENAME_EXCHANGE", "1").strip() != "0"
        return enabled and _exchange(a, b)

    def parent(self, location: str) -> str:
        return os.path.dirname(os.path.abspath(location))

    def free_bytes(self, location: str) -> int | None:
        probe = location
        while not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        stats = os.statvfs(probe or ".")
        return stats.f_bavail * stats.f_frsize

    def sync_dir(self, location: str) -> None:
        fd = os.open(location, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def tree_bytes(self, location: str) -> int:
        if not os.path.isdir(location):
            try:
                return os.lstat(location).st_size
            except FileNotFoundError:
                return 0
        total = 0
        for root, _, files in os.walk(location):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(root, name)).st_size
        return total


def _unsafe_ancestor(path: str) -> str | None:
    """Why another user could replace ``path`` through a directory above it (owned by
    someone but root and this user, or writable by others without the sticky bit), or
    ``None``. Both the path as named and with its links resolved are walked."""
    me, seen = os.geteuid(), set()
    for chain in (os.path.dirname(path), os.path.dirname(os.path.realpath(path))):
        prefix = os.sep
        for part in [p for p in chain.split(os.sep) if p] or [""]:
            prefix = os.path.join(prefix, part)
            if prefix in seen:
                continue
            seen.add(prefix)
            found = os.lstat(prefix)
            if found.st_uid not in (0, me):
                return (
                    f"{prefix}, above it, belongs to {_user(found.st_uid)}, who could put "
                    "another directory in its place"
                )
            mode = found.st_mode
            if stat.S_ISDIR(mode) and mode & 0o022 and not mode & stat.S_ISVTX:
                return (
                    f"{prefix}, above it, may be written by its group or other users and is "
                    f"not sticky (mode {stat.S_IMODE(mode):04o}): they could put another "
                    "directory in its place"
                )
    return None


def _not_a_directory(path: str) -> str:
    """Why ``path``, found to be no directory of its own, cannot be used as one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "it vanished while it was checked (another process removed it)"
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"it is a symbolic link (to {target}), which is never followed"
    kind = "a regular file" if stat.S_ISREG(mode) else _kind(mode)
    return f"it is {kind}, not a directory"


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, looked up once among the symbols the process has loaded
    (``ctypes.util.find_library`` would run ``ldconfig`` in a subprocess at every call);
    ``None`` where the C library has none."""
    return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _exchange(a: str, b: str) -> bool:
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        _log.debug("renameat2(RENAME_EXCHANGE) unsupported here (%s)", os.strerror(err))
        return False
    raise OSError(err, os.strerror(err), b)


def load_torch_file(path: str) -> Any:
    """``torch.load`` of a local regular file (a link to one is followed; a FIFO or device
    raises :class:`NotRegularFileError`) with ``weights_only=True``, memory-mapped where
    the file is in torch's zip format (an old-format file cannot be)."""
    import zipfile

    import torch

    os.close(open_regular(path, follow_links=True))
    return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
