"""The storage errors beyond the built-in :class:`OSError` subclasses: an object that is no
regular file, and a bucket that does not exist."""

from __future__ import annotations

import errno
import os


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
