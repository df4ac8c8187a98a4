"""The streams a :class:`~ddpckpt.storage.Storage` hands out: a :class:`Writer` for a new
object, a :class:`Reader` of a stored one, and :class:`RangedReader`, a reader for object
stores."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Any


class Writer(abc.ABC):
    """A new object being written as a stream, returned by :meth:`Storage.create`.

    ddpckpt calls :meth:`write` any number of times, then :meth:`sync` once, then
    :meth:`close` (also on failure: it is a context manager), all from one thread at a
    time (not necessarily the thread that created it). :meth:`sync` makes the object
    complete and durable; :meth:`close` without :meth:`sync` leaves at most a partial
    object that no manifest lists (and that the commit strategy's cleanup removes).
    Failures raise :class:`OSError`, as for :class:`Storage`.
    """

    @abc.abstractmethod
    def write(self, data: Any) -> None:
        """Append all of ``data`` (a short write is not allowed: loop until done).

        Args:
            data: A bytes-like object (``bytes``, ``memoryview``, a NumPy buffer); the
                caller may reuse its memory once this returns.

        Raises:
            OSError: The write failed (``ENOSPC`` when the store is full).
        """

    @abc.abstractmethod
    def sync(self) -> None:
        """Make everything written durable: ``fsync`` on a file system, the end of an
        upload on an object store (the object appears only now there). Called once, after
        the last :meth:`write`.

        Raises:
            OSError: The data may not be durable; ddpckpt commits nothing that lists it.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object's resources (a file descriptor, an unfinished upload);
        idempotent, and called after a failed :meth:`write` or :meth:`sync` too, so it
        should not raise."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Reader(abc.ABC):
    """An object opened for reading, returned by :meth:`Storage.open`: the bytes at the
    moment it was opened, even if the location is replaced or deleted meanwhile.

    ddpckpt may call :meth:`read_into` from several threads at once (ranged reads of one
    large file in parallel), then :meth:`close` once. It checks every byte it reads
    against the manifest's checksums, so a reader need not verify anything. Failures
    raise :class:`OSError`, as for :class:`Storage`.

    Attributes:
        size: The object's size in bytes when it was opened; set it in ``__init__``.
    """

    size: int

    @abc.abstractmethod
    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill a prefix of ``view`` with the object's bytes from ``offset`` on.

        Args:
            view: A writable buffer; fill as much of it as the object holds past
                ``offset``.
            offset: The position in the object to read from.

        Returns:
            The count of bytes filled: at least 1 while bytes remain (the caller asks
            again for the rest, as with ``pread``), 0 at or past the object's end.

        Raises:
            OSError: The read failed.
        """

    @abc.abstractmethod
    def map(self) -> Any:
        """The whole object as a writable buffer private to this reader (a copy-on-write
        memory map on POSIX, a ``bytearray`` filled by ranged reads on object stores);
        tensors are loaded straight from it.

        Returns:
            A writable buffer, or ``None`` when the object is empty.

        Raises:
            OSError: Reading or mapping failed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object; buffers from :meth:`map` stay valid. Idempotent."""

    def read_all(self) -> bytes:
        """All ``size`` bytes, by :meth:`read_into` (override only to do better).

        Returns:
            The bytes; fewer if the object shrank since it was opened.

        Raises:
            OSError: A read failed.
        """
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
