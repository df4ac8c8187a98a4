"""Preemption: one checkpoint at the same step on every rank when the job is told to stop.

The signals, the grace period and the handlers that record a signal are
:mod:`ddpckpt._run.signals`; this module turns a signal on any rank into one checkpoint at
the same step on every rank.

Agreement. With preemption on, ``should_save(step)`` is decided by rank 0 for every rank, as for
``every_seconds``: rank 0 publishes each step's answer in one store key that the other
ranks wait for (:meth:`ddpckpt._coord.comm.Comm.from_leader`), so no collective of the training
group runs and ranks that are a step or more apart (gradient accumulation) still read the
answer for the same step. A rank that received a signal posts it in one store key of the
current *round* before it waits for rank 0's answer; rank 0 answers "preempt" for the
first step at which it has seen a posted signal or received one itself. Every rank then
gets "preempt" for that same step, wherever it is. A signal rank 0 received is agreed at
its next ``should_save``; one that reached only other ranks is posted at their next
``should_save`` and agreed at rank 0's following one (usually one step later).

Per-step cost with preemption on: rank 0 one ``set`` on the store (a helper thread of rank
0 blocks in the store until a post appears, or an agreement or ``close()`` wakes it); every other rank one
``wait``, one ``get`` and one ``add`` (and the last reader two deletes): the cost of
``every_seconds``. Without it nothing changes (``every_steps`` is decided locally).

The save. The next :meth:`~ddpckpt.Checkpointer.save` is the preemption save: synchronous
even with ``async_save`` (a background save in flight is finished first); if the newest
save already holds that step (saved asynchronously at the step the signal came in), it is
only finished, not captured again. Its time is measured against the grace period, counted
from this rank's signal (or from the agreement on ranks that got none): the period is
``grace_seconds``, else ``$DDPCKPT_GRACE_SECONDS``, else torchrun's shutdown timeout under
torchrun, else 30 s (SLURM exports neither ``KillWait`` nor ``--signal``'s lead time: set
``DDPCKPT_GRACE_SECONDS`` in the batch script). If it runs out while the save is still
going, an ERROR names the checkpoint a resume would load; a save that ends late is
reported as an ERROR too. Afterwards :attr:`~ddpckpt.Checkpointer.preempted` is True and
:attr:`~ddpckpt.Checkpointer.exit_code` is ``128 + signal`` (143 for SIGTERM), the code a
shell gives a process the signal ended, so torchrun and SLURM see a failed attempt (and
restart or requeue it where configured) rather than a finished job. The library never
exits the process itself.

Edge cases. Signals that arrive while a preemption checkpoint is agreed or being written
(torchrun's forwarded SIGTERM after a SLURM SIGUSR1, a second SIGTERM) are folded into it;
one after it is saved starts another round. A signal during :meth:`resume` or any other
save is only recorded and agreed at the next ``should_save``. A rank SIGKILLed before the
agreement never hangs the others: they wait for rank 0 no longer than the Checkpointer's
``timeout``, and a save with a missing rank fails naming it. SIGKILL itself cannot be
caught: the grace period must exceed one step plus one save.

Several Checkpointers. Each preemption-enabled Checkpointer has its own store keys, named
by its rank-independent serial number (the how-many-th preemption-enabled Checkpointer of
this process it is): every rank must create them in the same order, as every rank must call
their ``should_save`` at the same steps anyway. A signal reaches every live one: each
preempts at its next ``should_save``. Closing one changes nothing for the others.

After close. :meth:`PreemptionWatch.close` restores the handlers that were installed before.
A signal that was received but never turned into a checkpoint (it came after the loop's
last ``should_save``) is then delivered again to the process, so it does what it would
have done without ddpckpt: SIGTERM under its default action ends the process at
``close()``. Until then (after the loop, or while a rank is blocked in a collective whose
peer died) such a signal is only recorded: the launcher's SIGKILL after its shutdown
timeout ends a process that never reaches ``close()``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ddpckpt._coord.store import StoreTimeout, default_group, namespace
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.signals import Preemption, SignalHandlers, grace_period, signal_name
from ddpckpt._training import worker_signals

_log = get_logger(__name__)

_serials = itertools.count()  # preemption-enabled Checkpointers made in this process
# How long the listener blocks in one store wait. Long, because torch's store client prints
# two warnings on stderr at every timed-out wait; an agreement and close() wake it instead.
_LISTEN_SLICE = timedelta(minutes=5)
_WAKE = b"{}"  # a value the listener reads as no post


@dataclass
class _Agreed:
    """A preemption checkpoint every rank agreed on: at ``step``, for signal ``signum``."""

    step: int
    signum: int
    origin: int  # the rank whose signal rank 0 saw first
    since: float  # monotonic time of this rank's signal, else of the agreement
    grace: float
    grace_source: str
    timer: threading.Timer | None = None
    started: float | None = None
    expired: bool = False


class PreemptionWatch:
    """One Checkpointer's preemption state on this rank (see the module docstring).

    The signal handler sets two fields; everything else runs on the training thread, in
    ``should_save`` and ``save`` (which every rank calls at the same steps).
    """

    def __init__(self, options: Preemption, newest: Callable[[], str]) -> None:
        self.options = options
        self._newest = newest  # describes the checkpoint a resume would load now
        self._signal: tuple[int, float] | None = None  # first signal not yet agreed on
        self._count = 0  # signals received
        self._round = 0  # preemption checkpoints agreed so far (the same on every rank)
        self._posted = -1  # the round this rank posted its signal in
        self.agreed: _Agreed | None = None
        self.preempted = False
        self.signum: int | None = None
        self._remote: tuple[int, dict[str, int]] | None = None  # (round, post) rank 0 saw
        self._listener: threading.Thread | None = None
        self._group: Any = None
        self._stop = threading.Event()
        grace_period(options.grace_seconds)  # a bad value fails now, not at the signal
        self._serial = next(_serials)  # the same on every rank: names this watch's keys
        signals = options.signal_numbers()
        self._handlers = SignalHandlers(signals, self._received)
        if self._handlers.installed:
            worker_signals.publish(self._serial, signals)

    def _received(self, signum: int) -> None:  # in the signal handler: no I/O, no locks
        self._count += 1
        if self._signal is None and self.agreed is None:
            self._signal = (signum, time.monotonic())

    # ------------------------------------------------------------------ agreement

    def _key(self, round_: int | None = None) -> str:
        """This watch's store key of ``round_`` (default: the current round)."""
        round_ = self._round if round_ is None else round_
        return f"{namespace()}/preempt/{self._serial}/{round_}"

    def announce(self) -> None:
        """Post this rank's signal for rank 0 (once per round); before the decision."""
        group = default_group()
        if self._signal is None or group is None or group.rank == 0 or self._posted == self._round:
            return
        record = {"rank": group.rank, "signal": self._signal[0]}
        group.store.set(self._key(), json.dumps(record).encode())
        self._posted = self._round

    def requested(self) -> bytes | None:
        """On rank 0, inside the decision: ``b"P<signal>,<rank>"`` if any rank was signalled."""
        if self.agreed is not None:
            return None
        if self._signal is not None:
            return b"P%d,0" % self._signal[0]
        group = default_group()
        if group is not None and self._listener is None:
            self._group = group
            self._listener = threading.Thread(
                target=self._listen, args=(group,), name="ddpckpt-preemption", daemon=True
            )
            self._listener.start()
        remote = self._remote
        if remote is None or remote[0] != self._round or remote[1].get("signal", 0) <= 0:
            return None
        return b"P%d,%d" % (remote[1]["signal"], remote[1]["rank"])

    def _listen(self, group: Any) -> None:
        """Rank 0's helper thread: blocks in the store until a rank posts a signal.

        So rank 0's step pays nothing to learn of other ranks' signals. An agreement wakes
        it to move on to the next round's key, ``close()`` to stop.
        """
        client, own = group.borrow()
        try:
            while not self._stop.is_set():
                current = self._round
                key = self._key(current)
                try:
                    client.wait([key], _LISTEN_SLICE)
                except StoreTimeout:
                    continue
                value = client.get(key)
                client.delete_key(key)
                if self._stop.is_set():  # close() woke it (its value is no post)
                    break
                self._remote = (current, json.loads(value))
                while self._round == current and not self._stop.wait(0.05):
                    pass  # until this round is agreed; later posts belong to the next one
        except RuntimeError as exc:  # the store went away (the job is ending)
            if not self._stop.is_set():
                _log.warning("ddpckpt preemption listener stopped: %s", exc)
        finally:
            group.give_back(client, own)

    def agree(self, step: int, decision: bytes) -> None:
        """Every rank, on rank 0's ``b"P..."`` decision for ``step``: the next save is it."""
        signum, origin = (int(x) for x in decision[1:].split(b","))
        own = self._signal
        grace, source = grace_period(self.options.grace_seconds)
        since = own[1] if own is not None else time.monotonic()
        self._signal = None
        if self._listener is not None and (self._remote is None or self._remote[0] != self._round):
            self._group.store.set(self._key(), _WAKE)  # it waits for this round's post
        self._round += 1
        self.agreed = _Agreed(step, signum, origin, since, grace, source)
        remaining = since + grace - time.monotonic()
        self.agreed.timer = threading.Timer(max(remaining, 0.0), self._expire, [self.agreed])
        self.agreed.timer.daemon = True
        self.agreed.timer.start()
        _log.warning(
            "%s received (rank %d first): every rank saves step %d now and then stops "
            "(Checkpointer.preempted); grace period %.3g s (%s)",
            signal_name(signum),
            origin,
            step,
            grace,
            source,
            extra=same_on_every_rank(),
        )

    def _expire(self, agreed: _Agreed) -> None:
        agreed.expired = True
        _log.error(
            "the grace period of %.3g s (%s) after %s ran out before the preemption "
            "checkpoint of step %d was saved: if the job is killed now, resume() loads %s",
            agreed.grace,
            agreed.grace_source,
            signal_name(agreed.signum),
            agreed.step,
            self._newest(),
            extra=same_on_every_rank(),
        )

    # ------------------------------------------------------------------ the save

    def run_save(self, save: Callable[[], str | None]) -> str | None:
        """Run the agreed preemption save (``save`` is synchronous) and report its timing."""
        agreed = self.agreed
        assert agreed is not None  # called only when a preemption was agreed
        agreed.started = time.monotonic()
        path = None
        try:
            path = save()
        finally:
            self._finish(agreed, path)
        return path

    def _finish(self, agreed: _Agreed, path: str | None) -> None:
        if agreed.timer is not None:
            agreed.timer.cancel()
        now = time.monotonic()
        self.agreed, self._signal = None, None  # signals during the save were for it
        self.preempted, self.signum = True, agreed.signum
        took = now - (agreed.started or now)
        after = now - agreed.since
        if path is None:
            _log.error(
                "the preemption checkpoint of step %d failed; resume() will load %s",
                agreed.step,
                self._newest(),
                extra=same_on_every_rank(),
            )
        elif after > agreed.grace:
            _log.error(
                "the preemption checkpoint %s took %.3g s and ended %.3g s after %s, later "
                "than the grace period of %.3g s (%s): a scheduler that enforces it kills the "
                "job before the save ends. Lengthen the grace period (and tell ddpckpt with "
                "grace_seconds= or DDPCKPT_GRACE_SECONDS) or save less often in between",
                path,
                took,
                after,
                signal_name(agreed.signum),
                agreed.grace,
                agreed.grace_source,
                extra=same_on_every_rank(),
            )
        else:
            _log.warning(
                "preemption checkpoint %s saved in %.3g s, %.3g s after %s (grace period "
                "%.3g s); stop training and exit with Checkpointer.exit_code (%d)",
                path,
                took,
                after,
                signal_name(agreed.signum),
                agreed.grace,
                self.exit_code,
                extra=same_on_every_rank(),
            )

    @property
    def exit_code(self) -> int:
        """``128 + signal`` once preempted (143 for SIGTERM), else 0."""
        return 128 + self.signum if self.preempted and self.signum is not None else 0

    def close(self) -> None:
        """Restore the handlers; report, then deliver again, a signal that led to no checkpoint.

        Local; call it last (a re-delivered SIGTERM ends the process here).
        """
        handlers = self._handlers.remove()
        worker_signals.withdraw(self._serial)
        self._stop.set()
        if self._listener is not None:  # wake it now rather than at its next timeout
            key = self._key()
            try:
                self._group.store.set(key, b"stop")  # read only with _stop set: no post
                self._listener.join(5)
                self._group.store.delete_key(key)  # if the listener had already stopped
            except RuntimeError as exc:  # the store is gone: the daemon thread ends with us
                _log.debug("preemption listener not woken: %s", exc)
        agreed = self.agreed
        if agreed is not None and agreed.timer is not None:
            agreed.timer.cancel()
        if agreed is not None:
            _log.error(
                "a preemption checkpoint was agreed for step %d but save() was not called "
                "before close(); resume() will load %s",
                agreed.step,
                self._newest(),
            )
        pending = self._signal[0] if self._signal is not None else None
        if agreed is not None:
            pending = agreed.signum
        elif pending is not None:
            _log.error(
                "%s was received but no should_save() call followed, so no preemption "
                "checkpoint was saved; resume() will load %s",
                signal_name(pending),
                self._newest(),
            )
        if pending is not None and handlers.get(pending) == signal.SIG_DFL:
            _log.error(
                "%s is delivered again now that the preemption handlers are removed: the "
                "process ends as it would have without preemption handling",
                signal_name(pending),
            )
            self.agreed, self._signal = None, None
            os.kill(os.getpid(), pending)
