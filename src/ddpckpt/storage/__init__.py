"""Where checkpoints are stored: a path or URL resolved to a :class:`Storage`.

``/data/run`` is the local file system, ``memory://name/run`` the in-memory store of this
process, ``s3://bucket/run`` S3-compatible object storage (extra ``ddpckpt[s3]``; see
:mod:`ddpckpt.storage.s3`), configured with the ``storage_options=`` of ``save``, ``load``
and ``Checkpointer``. Another backend subclasses :class:`Storage` and registers its URL
scheme with :func:`register` (a factory from the URL to a storage, e.g. one per bucket
and options): the one way to add a backend. :func:`storage_for` says which storage serves
a path.
"""

from __future__ import annotations

from typing import Any

from ddpckpt.storage._base import CommitStrategy, Storage
from ddpckpt.storage._commit import ManifestLastCommit, RenameCommit
from ddpckpt.storage._registry import register, storage_for
from ddpckpt.storage._streams import Reader, Writer

__all__ = [
    "CommitStrategy",
    "ManifestLastCommit",
    "Reader",
    "RenameCommit",
    "Storage",
    "Writer",
    "register",
    "storage_for",
]

_REPLACED = {  # deprecated spellings: what to use instead
    "configure": "the storage_options= argument of ddpckpt.save, ddpckpt.load or Checkpointer",
    "mount": "ddpckpt.storage.register (with a factory that returns your storage instance)",
    "resolve": "ddpckpt.storage.storage_for",
}


def __getattr__(name: str) -> Any:
    """The registry's other functions, public before (deprecated)."""
    if name in _REPLACED:
        from ddpckpt._deprecation import warn_renamed
        from ddpckpt.storage import _registry

        warn_renamed(f"ddpckpt.storage.{name}", _REPLACED[name])
        return getattr(_registry, name)
    raise AttributeError(f"module 'ddpckpt.storage' has no attribute {name!r}")
