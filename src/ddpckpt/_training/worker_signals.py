"""The signals that the DataLoader workers ddpckpt tracks ignore.

torchrun and SLURM signal a job's whole process group, and a torch DataLoader worker ends
on such a signal, failing the training loop before its preemption checkpoint. While a
Checkpointer with ``preemption`` is open, :mod:`ddpckpt._run.preemption` publishes the
signals it handles here; the ``worker_init_fn`` that :mod:`ddpckpt._training.loader` gives
every tracked loader (:class:`IgnoringPreemptionSignals`) makes its workers ignore them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from typing import Any

_published: dict[int, frozenset[int]] = {}  # a watch's key -> the signals it handles


def publish(key: int, signals: Iterable[int]) -> None:
    """Record that the watch ``key`` handles ``signals`` in this process (until withdrawn)."""
    _published[key] = frozenset(int(s) for s in signals)


def withdraw(key: int) -> None:
    """Forget the signals of the watch ``key`` (closed); a no-op if it published none."""
    _published.pop(key, None)


def watched_signals() -> frozenset[int]:
    """The preemption signals some live watch of this process handles."""
    return frozenset().union(*_published.values())


class IgnoringPreemptionSignals:
    """A DataLoader ``worker_init_fn``: ignore the preemption signals, then call ``inner``.

    torch runs it in each worker process after its own signal set-up. Under the ``fork``
    start method the worker reads the signals from the state it inherited; under ``spawn``
    they travel with the pickled function, taken when the workers start.
    """

    def __init__(self, inner: Callable[[int], Any] | None) -> None:
        self.inner = inner
        self.signals: list[int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "signals": sorted(watched_signals())}

    def __call__(self, worker_id: int) -> None:
        signals = watched_signals() if self.signals is None else self.signals
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)
