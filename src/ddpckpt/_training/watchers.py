"""Who watches the index batches tracked loaders hand to training.

Nobody, except in a process that runs under ``ddpckpt check-resume``: there the recorder
(:mod:`ddpckpt._resumecheck.record`) registers itself when ``ddpckpt`` is imported, before
any loader iterates. This package never imports the recorder (it sits above the training
helpers); loaders ask here instead. Local to the calling process.
"""

from __future__ import annotations

from typing import Any, Protocol


class BatchWatcher(Protocol):
    def batch(self, loader: Any, indices: Any) -> None:
        """``loader`` yielded the batch of sample ``indices`` to training."""


_watcher: list[BatchWatcher] = []


def watch_batches(watcher: BatchWatcher) -> None:
    """Have ``watcher`` told of every batch a tracked loader yields from now on."""
    _watcher[:] = [watcher]


def batch_watcher() -> BatchWatcher | None:
    """The registered watcher, or ``None`` (the usual case)."""
    return _watcher[0] if _watcher else None
