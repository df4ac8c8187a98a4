"""How bytes reach a local (or network-mounted POSIX) file system, durably and atomically.

Nothing here knows about ranks: :mod:`ddpckpt.io.checkpoint` decides which process calls
what. The commit protocol for a checkpoint directory ``D`` is:

1. every writer creates its files inside a temporary sibling ``.D.tmp-<token>`` with
   ``O_EXCL`` and fsyncs each file;
2. one process writes the manifest into it, fsyncs it and the temporary directory;
3. the temporary directory is renamed to ``D`` (atomically exchanged with an old ``D``
   when overwriting) and the parent directory is fsynced.

A reader therefore sees either no ``D`` or a complete one; a crash leaves at most a
temporary directory, which :func:`is_temp_name` recognises so it is never mistaken for a
checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid

from ddpckpt._log import get_logger

__all__ = [
    "commit_dir",
    "free_bytes",
    "fsync_dir",
    "is_temp_name",
    "new_token",
    "remove_tree",
    "temp_dir_for",
    "write_bytes_atomic",
    "write_bytes_new",
]

_log = get_logger(__name__)
_TEMP_MARK = ".tmp-"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_dir_for(final: str, token: str) -> str:
    """The temporary sibling in which the checkpoint ``final`` is assembled."""
    parent, name = os.path.split(os.path.normpath(final))
    return os.path.join(parent, f".{name}{_TEMP_MARK}{token}")


def is_temp_name(name: str) -> bool:
    """True for names of temporary (uncommitted) directories and files this library makes."""
    return name.startswith(".") and _TEMP_MARK in name


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_new(path: str, data: bytes) -> None:
    """Create ``path`` (which must not exist), write ``data`` and fsync the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old or the new content."""
    parent, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(parent, f".{name}{_TEMP_MARK}{new_token()}")
    try:
        write_bytes_new(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def commit_dir(tmp: str, final: str, *, overwrite: bool) -> None:
    """Publish the finished directory ``tmp`` as ``final`` and make the rename durable.

    If ``final`` exists it is replaced only with ``overwrite``: the two directories are
    exchanged atomically (Linux ``renameat2``) and the old one is removed; where the file
    system cannot exchange, the old one is renamed aside first, so it survives a crash
    as a temporary directory. Without ``overwrite`` an existing ``final`` raises
    ``FileExistsError``.
    """
    fsync_dir(tmp)
    parent = os.path.dirname(os.path.abspath(final))
    old: str | None = None
    if not os.path.lexists(final):
        os.rename(tmp, final)  # fails with ENOTEMPTY/EEXIST if another process won a race
    elif not overwrite:
        raise FileExistsError(errno.EEXIST, "checkpoint already exists", final)
    elif _exchange(tmp, final):
        old = tmp  # now holds the previous checkpoint
    else:
        old = temp_dir_for(final, new_token())
        os.rename(final, old)
        os.rename(tmp, final)
    fsync_dir(parent)
    if old is not None:
        remove_tree(old)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
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


def remove_tree(path: str) -> None:
    """Delete a checkpoint or temporary directory; a missing path is fine."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def free_bytes(path: str) -> int:
    """Free bytes available to this user on the file system holding ``path``."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    stats = os.statvfs(probe or ".")
    return stats.f_bavail * stats.f_frsize
