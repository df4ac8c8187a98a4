"""What each checkpoint cost, as it is committed: for experiment trackers and dashboards.

Every committed save (:func:`ddpckpt.save`, :meth:`ddpckpt.Checkpointer.save`,
:func:`ddpckpt.save_dict`) calls the listeners added with :func:`add_listener` with one
:class:`SaveEvent`, on each process that made the save (every rank for a collective
save, the one process for ``save_dict``). The framework integrations
(:mod:`ddpckpt.integrations`) send these to what the framework already logs to.

A listener runs on the thread that finishes the save: the caller's thread for a
synchronous save (before the save returns), ddpckpt's writer thread for an
asynchronous one (after the save returned, once the checkpoint is durable). Keep it
short and thread-safe; an exception it raises is logged as an ERROR and does not change
the save's outcome. A failed save sends no event (it raises, or a ``Checkpointer`` with
``on_error="warn"`` logs it). Without listeners nothing is measured.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from ddpckpt._log import get_logger
from ddpckpt.storage._location import Location

__all__ = ["SaveEvent", "add_listener"]

_log = get_logger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class SaveEvent:
    """One committed checkpoint, as seen by the process that reports it.

    What a listener added with :func:`add_listener` receives; ddpckpt makes it, a listener
    only reads it.

    Attributes:
        path: The checkpoint's path.
        step: The step saved with it (``None`` if none was given).
        stall_seconds: How long the save held the calling thread (training waits this
            long).
        durable_seconds: From the call until the checkpoint was committed and durable
            (equal to ``stall_seconds`` for a synchronous save, longer for an asynchronous
            one).
        nbytes: The size of the checkpoint's files (one copy; node-local storage holds one
            per node).
        verified: Every file and tensor was checksummed as it was written and the manifest
            listing the checksums is committed: every later load verifies the bytes
            against them. Always True in an event (a save that fails sends none).
    """

    path: str
    step: int | None
    stall_seconds: float
    durable_seconds: float
    nbytes: int
    verified: bool


_listeners: list[Callable[[SaveEvent], None]] = []
_lock = threading.Lock()


def add_listener(listener: Callable[[SaveEvent], None]) -> Callable[[], None]:
    """Call ``listener(event)`` for every committed save of this process from now on.

    Local: each process adds its own, on any thread; adding the same listener twice calls
    it twice. See the module's description for the thread a listener runs on; an
    exception it raises is logged as an ERROR (the save's outcome does not change).

    Args:
        listener: Called with one :class:`SaveEvent` per committed save.

    Returns:
        A function of no arguments that removes the listener (calling it twice is
        harmless).
    """
    with _lock:
        _listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return remove


class _Call:
    """One public save call being timed: it reports once it has both returned and committed."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.stall: float | None = None
        self.commit: tuple[str, int | None, int, float] | None = None
        self._lock = threading.Lock()

    def returned(self) -> None:
        with self._lock:
            self.stall = time.monotonic() - self.started
        self._report()

    def committed(self, path: str, step: int | None, nbytes: int) -> None:
        with self._lock:
            self.commit = (path, step, nbytes, time.monotonic() - self.started)
        self._report()

    def _report(self) -> None:
        with self._lock:
            if self.stall is None or self.commit is None:
                return
            path, step, nbytes, durable = self.commit
            event = SaveEvent(path, step, self.stall, max(durable, self.stall), nbytes, True)
            self.commit = None  # once
        _send(event)


_current: ContextVar[_Call | None] = ContextVar("ddpckpt_save_call", default=None)


def timed_save(func: F) -> F:
    """Decorate a public save call so that its commit is reported (when anyone listens)."""

    @functools.wraps(func)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _listeners:
            return func(*args, **kwargs)
        call = _Call()
        token = _current.set(call)
        try:
            return func(*args, **kwargs)
        finally:
            _current.reset(token)
            call.returned()

    return timed  # type: ignore[return-value]


def committed(location: Location, step: int | None) -> None:
    """Called by the write path once the checkpoint at ``location`` is committed and durable
    (in the context of the save call that planned it: asynchronous writers run in a copy of
    it)."""
    call = _current.get()
    if call is None:
        return
    from ddpckpt._format.manifest import read_manifest
    from ddpckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError

    path = location.path
    try:
        nbytes = read_manifest(location).nbytes
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        # deleted (or being replaced) by another thread or process right after it was
        # committed, as Lightning's AsyncCheckpointIO lets its top-k deletion do: the save
        # itself succeeded, so it must not fail; there is just nothing left to report
        _log.info("%s: committed, then deleted before it could be reported", path)
        return
    call.committed(path, step, nbytes)


def _send(event: SaveEvent) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(event)
        except Exception:  # the checkpoint is committed: a tracker's failure must not undo that
            _log.error("a checkpoint event listener failed for %s", event.path, exc_info=True)
