"""Persisting checkpoints in the background: one save in flight per :class:`Persister`.

A save that returns early hands the rest of its work (waiting for deferred snapshot copies,
hashing, writing, fsync, commit, retention) to a worker thread. A thread, not a process:
that work spends its time in system calls and in xxhash and tensor copies, all of which
release the GIL, and ``ddpckpt bench`` measures the training slowdown it causes next to a
writer process doing the same work (see BENCHMARKS.md).

Each save has its own :class:`Completion`: its handle (:class:`PendingSave`) reports that
save's outcome and nothing else. Saves stay ordered: the next one starts only after the
previous one is done. The worker is not a daemon: an interpreter that exits with a save
in flight finishes it first. A failure is logged when it happens and is raised again by
the next collective call (save or load) on **every** rank unless every rank has asked the
failed save's handle: that call decides together (:meth:`Persister.raise_unseen` runs
inside one of its collective steps), so ranks that looked at the handle and ranks that did
not never take different paths. Local calls (:meth:`Persister.join`,
:meth:`Persister.outcome`) report without deciding anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ddpckpt._log import get_logger, same_on_every_rank

_log = get_logger(__name__)


class Completion:
    """The outcome of one background save: running, done, or failed with an error."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._seen = False  # the error was handed to someone (a waiter or the next call)
        self.started = time.monotonic()
        self.finished: float | None = None  # time.monotonic() once done

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._finished.is_set()

    def wait(self) -> None:
        """Block until the save has finished; raise its error if it failed (every call)."""
        error = self.exception()
        if error is not None:
            raise error

    def exception(self) -> BaseException | None:
        """Block until the save has finished; its error, or ``None`` if it committed."""
        self._finished.wait()
        with self._lock:
            self._seen = True
            return self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self.finished = time.monotonic()
        self._finished.set()

    def _unseen_error(self) -> BaseException | None:
        """The error, if this rank has not been given it yet (and now it has)."""
        self._finished.wait()
        with self._lock:
            if self._seen:
                return None
            self._seen = True
            return self._error

    def _outcome(self) -> BaseException | None:
        """The error, without marking it seen."""
        self._finished.wait()
        return self._error


class Persister:
    """Runs background persistence jobs one at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.latest: Completion | None = None  # the most recently submitted job's

    @property
    def busy(self) -> bool:
        """Whether a job is running now."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], object], name: str) -> Completion:
        """Start ``job`` once the previous one is done. The caller has already settled the
        previous job's outcome (:meth:`raise_unseen` inside its collective call)."""
        self.join()
        completion = Completion(name)

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # kept for the handle and the next call (see wait)
                _log.error(
                    "background save %s failed: %s", name, exc, extra=same_on_every_rank(exc)
                )
                completion._finish(exc)
            else:
                completion._finish(None)

        self.latest = completion
        self._thread = threading.Thread(target=run, name=f"ddpckpt-persist {name}")
        self._thread.start()
        return completion

    def join(self) -> None:
        """Block until the job in flight is done; local, raises nothing."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def raise_unseen(self) -> None:
        """Raise the last job's error if this rank has not been given it yet.

        Call it as (part of) a step of a collective call, so that every rank raises when
        any rank does (see the module docstring).
        """
        self.join()
        if self.latest is not None:
            error = self.latest._unseen_error()
            if error is not None:
                raise error

    def outcome(self) -> BaseException | None:
        """Block until the job in flight is done; the last job's error (seen or not), or
        ``None``. Local: it marks nothing."""
        self.join()
        return None if self.latest is None else self.latest._outcome()


class PendingSave:
    """What an asynchronous :func:`ddpckpt.save` returns: the path, and that save's outcome.

    Local: ask it from the thread that saved, or from any other.

    Attributes:
        path: The checkpoint's path.
    """

    def __init__(self, path: str, completion: Completion) -> None:
        self.path = path
        self._completion = completion

    def done(self) -> bool:
        """Whether this save has finished, committed or failed; never blocks.

        Returns:
            True once :meth:`wait` would return or raise at once.
        """
        return self._completion.done()

    def wait(self) -> str:
        """Block until this checkpoint is committed and durable.

        Returns:
            The checkpoint's path.

        Raises:
            Exception: This save's own error (a CheckpointWriteError ...), every time it is
                asked, if it failed.
        """
        self._completion.wait()
        return self.path

    def exception(self) -> BaseException | None:
        """Block until this save has finished, and return its error instead of raising it.

        Returns:
            The error :meth:`wait` would raise, or ``None`` if the save committed.
        """
        return self._completion.exception()

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"PendingSave({self.path!r}, done={self.done()})"
