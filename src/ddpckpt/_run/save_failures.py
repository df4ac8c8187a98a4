"""What a :class:`~ddpckpt.Checkpointer` does when a save fails in storage.

Transient errors (a network file system's hiccups, not a full or read-only disk) are
retried with exponential backoff; then, with ``on_error="warn"``, every failed save is
logged as an ERROR that counts the consecutive failures and names the newest good
checkpoint, and training goes on; with ``"raise"`` the error is raised. The bookkeeping is
per rank; the Checkpointer calls it at the same points on every rank (see
:mod:`ddpckpt._io.background` for how a background failure reaches every rank together).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable

from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.options import FailureHandling
from ddpckpt._run.tiernames import TierNames
from ddpckpt.errors import CheckpointError, CheckpointWriteError, InsufficientSpaceError

_log = get_logger(__name__)
_TRANSIENT = {
    errno.EIO,
    errno.EAGAIN,
    errno.EINTR,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ESTALE,
    errno.ECONNRESET,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
}


class SaveFailures:
    """Retries, ``on_error`` and the record of failed saves (``last_error``, ``failed_saves``)."""

    def __init__(self, options: FailureHandling, names: TierNames | None = None) -> None:
        self.on_error, self.retries = options.on_error, options.retries
        self.names = names or TierNames.durable("")  # which tier's saves, in messages
        self.retry_backoff = options.retry_backoff
        self.last_error: CheckpointError | None = None
        self.failed_saves = 0
        self._reported: BaseException | None = None  # a background failure already logged here

    def _newest_good(self, newest: str | None) -> str:
        if newest is not None:
            return f"the newest good checkpoint is still {newest}"
        return self.names.none_yet

    def retrying(self, path: str, attempt: Callable[[int], object]) -> None:
        """Call ``attempt(n)`` until it succeeds (what it returns is dropped), retrying
        transient storage errors."""
        for n in range(self.retries + 1):
            try:
                attempt(n)
                break
            except CheckpointWriteError as exc:
                transient = exc.errno in _TRANSIENT and not isinstance(exc, InsufficientSpaceError)
                if not transient or n == self.retries:
                    raise
                delay = self.retry_backoff * 2**n
                _log.warning(
                    "saving %s failed (%s); retrying in %.1f s",
                    path,
                    exc,
                    delay,
                    extra=same_on_every_rank(exc),
                )
                time.sleep(delay)
        self.last_error, self.failed_saves = None, 0

    def failed(self, step: int | None, exc: CheckpointError, newest: str | None) -> None:
        """Record a failed (or refused) save; raise it (``on_error="raise"``) or log it
        loudly. ``newest`` names the newest good checkpoint (``None``: there is none)."""
        self.last_error = exc
        self.failed_saves += 1
        if self.on_error == "raise":
            raise exc
        if exc is self._reported:  # already logged by wait() on this rank
            return
        _log.error(
            "%ssaving step %s failed (%s) and training goes on (on_error='warn'); %s. Cause: %s",
            self.names.prefix,
            step,
            _consecutive(self.failed_saves),
            self._newest_good(newest),
            exc,
            extra=same_on_every_rank(exc),
        )

    def report_background(self, error: BaseException | None, newest: str | None) -> None:
        """Report a finished background save's failure on this rank, deciding nothing (the
        next collective call counts it). ``newest`` as for :meth:`failed`."""
        if not isinstance(error, CheckpointWriteError) or error is self._reported:
            if error is not None and not isinstance(error, CheckpointWriteError):
                raise error  # a bug, or a lost lock: always raised
            return
        self._reported = error
        if self.on_error == "raise":
            raise error
        _log.error(
            "%sa background save failed (%s) and training goes on (on_error='warn'); %s. Cause: %s",
            self.names.prefix,
            _consecutive(self.failed_saves + 1),
            self._newest_good(newest),
            error,
            extra=same_on_every_rank(error),
        )


def _consecutive(count: int) -> str:
    return f"{count} consecutive failed save{'' if count == 1 else 's'}"
