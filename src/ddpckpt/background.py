"""Persisting checkpoints in the background: one save in flight per :class:`Persister`.

A save that returns early hands the rest of its work (waiting for deferred snapshot copies,
hashing, writing, fsync, commit, retention) to a worker thread. A thread, not a process:
that work spends its time in system calls and in xxhash and tensor copies, all of which
release the GIL, and ``ddpckpt bench`` measures the training slowdown it causes next to a
writer process doing the same work (see BENCHMARKS.md).

The worker is not a daemon: an interpreter that exits with a save in flight finishes it
first. An error in the background is kept and raised by the next call to :meth:`wait`,
which every later save and load make first, so it surfaces on every rank (the error is
the same on every rank, since the work is collective).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ._log import get_logger

__all__ = ["PendingSave", "Persister"]

_log = get_logger(__name__)


class Persister:
    """Runs background persistence jobs one at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], object], name: str) -> None:
        """Start ``job`` once the previous one is done (raising its error, if any)."""
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # kept for the training thread (see wait)
                self._error = exc
                _log.error(
                    "background save %s failed (raised at the next ddpckpt call): %s", name, exc
                )

        self._thread = threading.Thread(target=run, name=f"ddpckpt-persist {name}")
        self._thread.start()

    def wait(self) -> None:
        """Block until the job in flight is done; raise the error it ended with, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


class PendingSave:
    """What an asynchronous :func:`ddpckpt.save` returns: the path, and a way to wait."""

    def __init__(self, path: str, persister: Persister) -> None:
        self.path = path
        self._persister = persister

    def done(self) -> bool:
        return not self._persister.busy

    def wait(self) -> str:
        """Block until the checkpoint is committed and durable; raises if the save failed."""
        self._persister.wait()
        return self.path

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"PendingSave({self.path!r}, done={self.done()})"
