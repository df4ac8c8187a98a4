"""The preemption signals: which ones, how long until SIGKILL, and handlers that record them.

Schedulers announce the end of a job with a signal and a grace period before SIGKILL:
``torchrun`` forwards SIGTERM (and whatever ``--signals-to-handle`` lists, e.g.
``SIGUSR1,SIGUSR2``) from its agent to every worker, then waits ``--shutdown-timeout``
(``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default) before SIGKILL; Kubernetes sends
SIGTERM and waits ``terminationGracePeriodSeconds`` (30 s by default); SLURM sends SIGTERM
at the time limit and SIGKILL ``KillWait`` seconds later, and ``--signal=[B:]SIG@T`` sends
SIG (e.g. USR1) T seconds before the limit, possibly to the batch shell or one node only.

With ``Checkpointer(..., preemption=True)`` every rank installs a handler for SIGTERM and
SIGUSR1 (or :attr:`Preemption.signals`). The handler only records the signal (no I/O, no
lock) and then calls the handler installed before it, if that is a Python function;
SIG_DFL is not called (it would end the process before the save) and SIG_IGN stays
ignoring. Handlers are installed from the main thread only (Python allows no other) and
restored by :meth:`SignalHandlers.remove`.

DataLoader workers. torchrun and SLURM signal each worker's whole process group, and
torch's DataLoader worker processes end on such a signal; the training thread then fails at
the next batch it needs from them, before the checkpoint. The workers of every DataLoader
ddpckpt tracks (:func:`~ddpckpt.data.track_loader`, one in a Checkpointer's ``extra``) ignore the preemption signals while preemption is on in the
process (their ``worker_init_fn``, :mod:`ddpckpt._training.worker_signals`, sets SIG_IGN after
torch's own set-up); they still end
when the loader shuts them down or the training process dies. A DataLoader ddpckpt does not
track keeps torch's behaviour: its workers die with the signal. Pass it in ``extra`` (or
give it a ``worker_init_fn`` that ignores the signals).

The cross-rank agreement on the step to save at is :mod:`ddpckpt._run.preemption`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ddpckpt._log import get_logger

_log = get_logger(__name__)

DEFAULT_GRACE_SECONDS = 30.0
_Handler = Callable[[int, FrameType | None], Any] | int | None


@dataclass(frozen=True)
class Preemption:
    """What ``Checkpointer(preemption=...)`` watches: ``True`` means ``Preemption()``.

    ``signals``: signal numbers or names (default SIGTERM and SIGUSR1). ``grace_seconds``:
    the time between the signal and SIGKILL (default: see :func:`grace_period`).
    """

    signals: Sequence[int | str] = ("SIGTERM", "SIGUSR1")
    grace_seconds: float | None = None

    @classmethod
    def of(cls, value: bool | Preemption | None) -> Preemption | None:
        """The options ``Checkpointer(preemption=value)`` stands for (``None``: off)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, Preemption):
            return value
        raise TypeError(f"preemption must be True, False or a ddpckpt.Preemption, got {value!r}")

    def signal_numbers(self) -> list[signal.Signals]:
        numbers = []
        for sig in self.signals:
            try:
                numbers.append(signal.Signals[sig] if isinstance(sig, str) else signal.Signals(sig))
            except (KeyError, ValueError):
                raise ValueError(f"Preemption(signals=...): {sig!r} is not a signal") from None
            if numbers[-1] in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(
                    f"{numbers[-1].name} cannot be caught; it cannot announce anything"
                )
        return numbers


def grace_period(grace_seconds: float | None = None) -> tuple[float, str]:
    """The grace period in seconds and where it came from (for messages).

    ``grace_seconds``, else ``$DDPCKPT_GRACE_SECONDS``, else under torchrun its shutdown
    timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default), else 30 s (the default
    of Kubernetes' ``terminationGracePeriodSeconds`` and of SLURM's ``KillWait``).
    """
    if grace_seconds is not None:
        value, source = grace_seconds, "grace_seconds"
    elif os.environ.get("DDPCKPT_GRACE_SECONDS", "").strip():
        raw, source = os.environ["DDPCKPT_GRACE_SECONDS"], "DDPCKPT_GRACE_SECONDS"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"DDPCKPT_GRACE_SECONDS={raw!r} is not a number of seconds") from None
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip()
        value = float(raw) if raw.isdigit() else DEFAULT_GRACE_SECONDS
        source = "torchrun's shutdown timeout"
    else:
        value, source = DEFAULT_GRACE_SECONDS, "the default; set DDPCKPT_GRACE_SECONDS"
    if not value > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {value!r}")
    return float(value), source


class SignalHandlers:
    """Our handler for ``signals``, chained to the ones installed before; main thread only."""

    def __init__(self, signals: Sequence[signal.Signals], on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._previous: dict[int, _Handler] = {}
        self.removed = False
        if threading.current_thread() is not threading.main_thread():
            _log.warning(
                "preemption handling is off on this rank: signal handlers can only be "
                "installed from the main thread, and this Checkpointer was created in thread "
                "%r. Create it in the main thread",
                threading.current_thread().name,
            )
            return
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
            signal.siginterrupt(sig, False)  # system calls resume; C++ code need not retry

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.removed:
            self._on_signal(signum)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def remove(self) -> dict[int, _Handler]:
        """Put the previous handlers back where ours is still the one installed.

        Returns the handler each signal has now. A handler installed over ours may still
        chain to ours, which then only chains on; where another Checkpointer's handler is
        put back after that Checkpointer was closed, what it had replaced is put back.
        """
        self.removed = True
        if threading.current_thread() is not threading.main_thread():
            if self._previous:
                _log.warning(
                    "preemption signal handlers stay installed: close() ran off the main thread"
                )
            return {}
        now = {}
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                handler = _unwrap_removed(sig, handler)
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            now[sig] = signal.getsignal(sig)
        return now


def _unwrap_removed(sig: int, handler: _Handler) -> _Handler:
    """``handler``, or what it replaced if it is a removed Checkpointer's (recursively)."""
    owner = getattr(handler, "__self__", None)
    while isinstance(owner, SignalHandlers) and owner.removed:
        handler = owner._previous.get(sig, signal.SIG_DFL)
        owner = getattr(handler, "__self__", None)
    return handler


def signal_name(signum: int) -> str:
    """``"SIGTERM"``, or ``"signal N"`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
