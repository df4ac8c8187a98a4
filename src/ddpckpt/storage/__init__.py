"""Where checkpoints are stored: a path or URL resolved to a :class:`Storage`.

``/data/run`` is the local file system, ``memory://name/run`` the
in-memory store of this process, ``s3://bucket/run`` S3-compatible object storage (extra
``ddpckpt[s3]``; see :mod:`ddpckpt.storage.s3`). Another backend registers its URL scheme with
:func:`register` (a factory from the URL to a storage, e.g. one per bucket and options);
:func:`mount` serves one URL prefix from a given storage instance.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ddpckpt.storage.base import (
    CommitStrategy,
    ManifestLastCommit,
    Reader,
    RenameCommit,
    Storage,
    Writer,
    is_temp_name,
    new_token,
)
from ddpckpt.storage.memory import MemoryStorage
from ddpckpt.storage.posix import PosixStorage

__all__ = [
    "CommitStrategy",
    "ManifestLastCommit",
    "Reader",
    "RenameCommit",
    "Storage",
    "Writer",
    "is_temp_name",
    "mount",
    "new_token",
    "register",
    "resolve",
    "storage_for",
]

_lock = threading.Lock()
_posix = PosixStorage()
_memory = MemoryStorage()


def _s3(url: str) -> Storage:
    from ddpckpt.storage.s3 import default_storage  # boto3 is optional: imported on use

    return default_storage(url)


_schemes: dict[str, Callable[[str], Storage]] = {"memory": lambda url: _memory, "s3": _s3}
_mounts: dict[str, Storage] = {}


def register(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Serve ``scheme://...`` URLs from ``factory(url)`` (called for each resolution)."""
    with _lock:
        _schemes[scheme] = factory


def mount(prefix: str, storage: Storage | None) -> None:
    """Serve every location under the URL ``prefix`` from ``storage`` (``None`` unmounts)."""
    with _lock:
        if storage is None:
            _mounts.pop(prefix.rstrip("/"), None)
        else:
            _mounts[prefix.rstrip("/")] = storage


def resolve(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    """The storage holding ``path`` and the location to pass it: the path as given, so
    messages name it as the user wrote it."""
    location = os.fspath(path)
    scheme, sep, _ = location.partition("://")
    if not sep or "/" in scheme:
        return _posix, location
    with _lock:
        for prefix in sorted(_mounts, key=len, reverse=True):
            if location == prefix or location.startswith(prefix + "/"):
                return _mounts[prefix], location
        factory = _schemes.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in sorted(_schemes))
        raise ValueError(
            f"{location}: no storage for {scheme}:// URLs (known: {known}, and local paths)"
        )
    return factory(location), location


def storage_for(path: str | os.PathLike[str]) -> Storage:
    """The storage holding ``path`` (see :func:`resolve`)."""
    return resolve(path)[0]
