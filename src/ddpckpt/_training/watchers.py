"""Who watches the index batches tracked loaders hand to training.

Nobody, except in a process that runs under ``ddpckpt check-resume``: there the recorder
(:mod:`ddpckpt._resumecheck.record`), which registers how to find it when it is imported
(by ``import ddpckpt``). This package never imports the recorder (it sits above the
training helpers); loaders ask here instead. Local to the calling process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class BatchWatcher(Protocol):
    def batch(self, loader: Any, indices: Any) -> None:
        """``loader`` yielded the batch of sample ``indices`` to training."""


_provider: list[Callable[[], BatchWatcher | None]] = []


def watch_batches(provider: Callable[[], BatchWatcher | None]) -> None:
    """Have ``provider()`` (the watcher, or ``None``) asked at every batch a tracked loader
    yields from now on."""
    _provider[:] = [provider]


def batch_watcher() -> BatchWatcher | None:
    """The watcher of this process, or ``None`` (the usual case)."""
    return _provider[0]() if _provider else None
