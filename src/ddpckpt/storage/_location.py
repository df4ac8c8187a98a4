"""A path or URL resolved once: the :class:`Location` every layer below the public calls
takes, in place of a string each layer would resolve again.

A public call (``save``, ``load``, ``load_latest``, a ``Checkpointer``, a command) turns the
path it was given into a location with :func:`locate`, once, after it has configured the
URL's storage (``storage_options=``) and after check-resume has mapped it; the layers below
take that location, and the places they read or write are derived from it (:meth:`join`,
:attr:`~Location.parent`) on the same storage. So a call resolves each path it was given
once, whatever the number of files, ranks or checkpoints it then touches.

Why the same storage serves what lies below a location: a storage serves a whole URL
scheme, or a whole bucket (``storage_options=``), and check-resume's guard refuses writes
by prefix; none serves part of a tree differently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddpckpt.storage._base import Storage
from ddpckpt.storage._registry import storage_for


@dataclass(frozen=True)
class Location:
    """A path or URL (``path``, as the user wrote it) and the storage serving it.

    It formats as its path (``f"{location}: ..."`` names the user's path), but it is no
    string: a layer that holds one cannot hand it to :func:`storage_for` again by mistake.
    """

    storage: Storage
    path: str

    def __str__(self) -> str:
        return self.path

    def join(self, *names: str) -> Location:
        """The location of ``names`` below this one, on the same storage."""
        return Location(self.storage, os.path.join(self.path, *names))

    @property
    def parent(self) -> Location:
        """The directory (or prefix) holding this location, on the same storage, as the
        storage spells it (absolute where it has a working directory)."""
        return Location(self.storage, self.storage.parent(self.path))

    @property
    def name(self) -> str:
        """The last component of the path."""
        return os.path.basename(self.path.rstrip("/"))


def locate(path: str | os.PathLike[str]) -> Location:
    """``path`` resolved to the storage serving it (see the module docstring: the public
    calls resolve each path they were given once, here); local.

    Raises:
        ValueError: No storage serves the URL's scheme.
    """
    return Location(storage_for(path), os.fspath(path))
