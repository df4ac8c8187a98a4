"""Rank-aware logging for the library, visible on stderr without any set-up.

All modules log through ``logging.getLogger("ddpckpt.<module>")``. The package logger
carries a filter that

* sets ``record.rank`` (the global rank, or 0 outside ``torch.distributed``) so a
  formatter can print it, and
* by default lets INFO and DEBUG records through on rank 0 only, so an N-rank job does
  not print every message N times. Warnings and errors pass on every rank, except a
  failure that every rank reports with the same text (a collective error, see
  :func:`same_on_every_rank`): rank 0 prints it, plus any rank that failed itself while
  rank 0 did not. Set ``DDPCKPT_LOG_ALL_RANKS=1`` to see every rank's messages.

Where messages go (the choice, and why): a failed save, a fallback to an older
checkpoint or a stale lock taken over must reach the user even if the application never
configured ``logging``, or a run can "save" into a full disk for days. ``warnings.warn``
would show each message once per place in the code and not say which rank; so the
``ddpckpt`` logger has a handler of its own that writes WARNING and above to stderr
(``ddpckpt WARNING [rank 1]: ...``) *only while the application has configured no
logging*: the root logger has no handler and no logger between the message's and the
root has a handler other than this one. As soon as the application configures logging
(``logging.basicConfig``, a handler on ``"ddpckpt"``, ...) messages go only through its
handlers, exactly once. To silence the library, set the ``"ddpckpt"`` logger's level or
give it a ``logging.NullHandler()`` with ``propagate = False``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

_PACKAGE = "ddpckpt"
_SAME_EVERYWHERE = "ddpckpt_same_on_every_rank"
_OBSERVERS: list[Callable[[logging.LogRecord], None]] = []


def observe(callback: Callable[[logging.LogRecord], None]) -> Callable[[], None]:
    """Call ``callback`` with every WARNING or worse that the library logs in this process,
    printed or not (``ddpckpt check-resume`` quotes a run's warnings in its report);
    returns the function that stops it."""
    _OBSERVERS.append(callback)
    return lambda: _OBSERVERS.remove(callback)


def current_rank() -> int:
    """The global rank of this process (0 without an initialised default process group)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError, ValueError):
        pass
    return int(os.environ.get("RANK", "0") or 0)


def same_on_every_rank(error: BaseException | None = None) -> Mapping[str, Any]:
    """``extra=`` for a record that every rank logs with the same text.

    Such a record is printed by rank 0 only (its text lists every rank's failure), and
    also by a rank that failed itself while rank 0 did not (its entry in
    ``error.failures``, see :class:`~ddpckpt.errors.CheckpointError`), so that the log
    of the node where things went wrong shows it too.
    """
    rank = current_rank()
    failures = getattr(error, "failures", None) or {}
    own = rank in failures and 0 not in failures
    return {_SAME_EVERYWHERE: not own}


def all_ranks() -> bool:
    """Whether the user asked for every rank's messages (``DDPCKPT_LOG_ALL_RANKS=1``)."""
    return os.environ.get("DDPCKPT_LOG_ALL_RANKS", "") not in ("", "0")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        if record.levelno >= logging.WARNING:
            for callback in _OBSERVERS:
                callback(record)
        if rank == 0 or all_ranks():
            return True
        if getattr(record, _SAME_EVERYWHERE, False):
            return False
        return record.levelno >= logging.WARNING


class _StderrUntilConfigured(logging.Handler):
    """WARNING and above to stderr, while the application has configured no logging."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rank = getattr(record, "rank", None)
            where = f" [rank {rank}]" if rank is not None else ""
            stream = sys.stderr
            if stream is None:  # pythonw and friends
                return
            stream.write(f"ddpckpt {record.levelname}{where}: {record.getMessage()}\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_HANDLER = _StderrUntilConfigured()
logging.getLogger(_PACKAGE).addHandler(_HANDLER)


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (a child of the ``ddpckpt`` logger)."""
    if not name.startswith(_PACKAGE):
        name = f"{_PACKAGE}.{name}"
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        # Filters on a parent logger do not apply to records created on a child.
        logger.addFilter(_RankFilter())
    return logger
