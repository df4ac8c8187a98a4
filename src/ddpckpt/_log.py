"""Rank-aware logging for the library.

All modules log through ``logging.getLogger("ddpckpt.<module>")``. The package logger
carries a filter that

* sets ``record.rank`` (the global rank, or 0 outside ``torch.distributed``) so a
  formatter can print it, and
* by default lets INFO and DEBUG records through on rank 0 only, so an N-rank job does
  not print every message N times. Warnings and errors pass on every rank. Set
  ``DDPCKPT_LOG_ALL_RANKS=1`` to see every rank's INFO messages.

The library never adds handlers or prints; configure ``logging`` in the application.
"""

from __future__ import annotations

import logging
import os

__all__ = ["current_rank", "get_logger"]

_PACKAGE = "ddpckpt"


def current_rank() -> int:
    """The global rank of this process (0 without an initialised default process group)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError, ValueError):
        pass
    return int(os.environ.get("RANK", "0") or 0)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        if record.levelno >= logging.WARNING or rank == 0:
            return True
        return os.environ.get("DDPCKPT_LOG_ALL_RANKS", "") not in ("", "0")


logging.getLogger(_PACKAGE).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (a child of the ``ddpckpt`` logger)."""
    if not name.startswith(_PACKAGE):
        name = f"{_PACKAGE}.{name}"
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        # Filters on a parent logger do not apply to records created on a child.
        logger.addFilter(_RankFilter())
    return logger
