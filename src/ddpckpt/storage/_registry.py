"""Which storage serves a path or URL: the registry of URL schemes, of URL prefixes served
from given instances, and of storages made from ``storage_options``.

:func:`register` and :func:`storage_for` are public (:mod:`ddpckpt.storage`); the rest is
what ``save``, ``load`` and ``Checkpointer`` call with their ``storage_options=``
(:func:`configure`), and what check-resume's path isolation wraps (``_guard``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ddpckpt.storage._base import Storage
from ddpckpt.storage._memory import MemoryStorage
from ddpckpt.storage._posix import PosixStorage

_lock = threading.Lock()
_local = PosixStorage()  # local paths (not named _posix: that is its module)
_memory = MemoryStorage()


def _s3(url: str) -> Storage:
    from ddpckpt.storage.s3 import default_storage  # boto3 is optional: imported on use

    return default_storage(url)


def _s3_configured(options: Mapping[str, Any]) -> Storage:
    from ddpckpt.storage.s3 import S3Storage

    return S3Storage.from_options(options)


_schemes: dict[str, Callable[[str], Storage]] = {"memory": lambda url: _memory, "s3": _s3}
_configurable: dict[str, Callable[[Mapping[str, Any]], Storage]] = {"s3": _s3_configured}
_configured: dict[tuple[str, str], Storage] = {}  # one storage per scheme and options
_mounts: dict[str, Storage] = {}
# Under ``ddpckpt check-resume`` only: wraps the storage of a location outside the check's
# directory so that it refuses writes (ddpckpt._resumecheck.isolate); None otherwise.
_guard: Callable[[Storage, str], Storage] | None = None


def register(
    scheme: str,
    factory: Callable[[str], Storage],
    *,
    configured: Callable[[Mapping[str, Any]], Storage] | None = None,
) -> None:
    """Serve ``scheme://...`` URLs from a storage of your own; local.

    Call it in every process (at import of your backend's module, say) before the first
    save or load of such a URL. The factory serves the whole scheme: to serve some buckets
    your own way, let it choose by URL and hand the rest to the scheme's former factory
    (for ``s3``, :func:`ddpckpt.storage.s3.default_storage`). A bucket configured with
    ``storage_options=`` in this process is served by that configuration instead.

    Args:
        scheme: The URL scheme, without ``://`` (``"gs"``).
        factory: Called with each URL resolved (``"gs://bucket/run/step-1"``); returns
            the :class:`Storage` serving it (typically one per bucket, reused).
        configured: Makes a storage from the ``storage_options=`` mapping given to
            ``save``, ``load`` or ``Checkpointer`` with such a URL. Without it, such URLs
            take no options.
    """
    with _lock:
        _schemes[scheme] = factory
        if configured is not None:
            _configurable[scheme] = configured


def configure(path: str | os.PathLike[str], options: Mapping[str, Any] | None) -> None:
    """Serve the bucket of the URL ``path`` from a storage made with ``options``; local.

    ``save``, ``load`` and ``Checkpointer`` call it with their ``storage_options=``. A
    checkpoint's run directory and its neighbours live in the bucket (``s3://bucket``).
    Equal options share one storage (one connection pool); the options given last for a
    bucket serve it. Messages name options, never their values.

    Args:
        path: A URL (``s3://bucket/run``).
        options: For ``s3://``: endpoint, region, profile, credentials, timeouts (see
            :meth:`S3Storage.from_options <ddpckpt.storage.s3.S3Storage.from_options>`).
            Nothing to do when ``None`` or empty.

    Raises:
        ValueError: ``path`` is a local path, or its scheme takes no options.
    """
    if not options:
        return
    location = os.fspath(path)
    scheme, sep, rest = location.partition("://")
    if not sep or "/" in scheme:
        raise ValueError(
            f"{location}: storage_options apply to URLs such as s3://bucket/run; "
            "a local path takes none"
        )
    with _lock:
        make = _configurable.get(scheme)
    if make is None:
        raise ValueError(f"{location}: {scheme}:// locations take no storage_options")
    text = json.dumps(dict(options), sort_keys=True, default=repr)
    key = (scheme, hashlib.sha256(text.encode()).hexdigest())
    with _lock:
        storage = _configured.get(key)
    if storage is None:
        made = make(options)
        with _lock:
            storage = _configured.setdefault(key, made)
    mount(f"{scheme}://{rest.strip('/').split('/')[0]}", storage)


def mount(prefix: str, storage: Storage | None) -> None:
    """Serve every location under the URL ``prefix`` from ``storage``; local.

    Args:
        prefix: A URL prefix (``"s3://bucket"``); the longest mounted prefix wins.
        storage: The storage instance, or ``None`` to unmount.
    """
    with _lock:
        if storage is None:
            _mounts.pop(prefix.rstrip("/"), None)
        else:
            _mounts[prefix.rstrip("/")] = storage


def resolve(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    """:func:`storage_for` ``path``, and the path as given (deprecated public spelling)."""
    return storage_for(path), os.fspath(path)


def _resolve(location: str) -> Storage:
    scheme, sep, _ = location.partition("://")
    if not sep or "/" in scheme:
        return _local
    with _lock:
        for prefix in sorted(_mounts, key=len, reverse=True):
            if location == prefix or location.startswith(prefix + "/"):
                return _mounts[prefix]
        factory = _schemes.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in sorted(_schemes))
        raise ValueError(
            f"{location}: no storage for {scheme}:// URLs (known: {known}, and local paths)"
        )
    return factory(location)


def storage_for(path: str | os.PathLike[str]) -> Storage:
    """The storage holding ``path``; local.

    Pass it ``path`` itself (a storage takes whole paths and URLs, and its messages name
    them as you wrote them).

    Args:
        path: A local path or a URL.

    Returns:
        The :class:`Storage` serving it.

    Raises:
        ValueError: No storage serves the URL's scheme.
    """
    location = os.fspath(path)
    storage = _resolve(location)
    return storage if _guard is None else _guard(storage, location)
