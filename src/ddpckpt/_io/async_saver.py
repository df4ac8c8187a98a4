"""Asynchronous saves: an :class:`AsyncSaver` owns the host buffer, the background writer
and the optimizer fences of one stream of saves.

:func:`ddpckpt.save` uses one default instance (:data:`DEFAULT_SAVER`); every
:class:`~ddpckpt.Checkpointer` has its own, so a run's saves never wait for, or reuse the
buffer of, saves made elsewhere. A save stages this rank's tensors into the pool
(:mod:`ddpckpt._io.staging`) and hands writing and committing to the persister
(:mod:`ddpckpt._io.background`), which runs one save at a time and reports each save's
outcome to its handle and to the next collective call.

Two savers that save the same snapshot (a Checkpointer's durable and fast tiers at one
step) copy it once: the second one's :meth:`AsyncSaver.start` is given the first
(``borrow``, an ``AsyncSaver(lends=True)``) and reads the host copies that one staged of
the same tensors, copying only the others; the lender then waits for the borrower's write
before it stages again.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddpckpt._io.background import Completion, Persister
from ddpckpt._io.staging import Fence, StagingPool
from ddpckpt._io.write_plan import WritePlan
from ddpckpt._io.writing import write_and_commit
from ddpckpt._log import get_logger
from ddpckpt._state.capture import Snapshot, TrainingState

_log = get_logger(__name__)


def async_mode(async_save: bool | str, state: TrainingState) -> bool:
    """Validate ``async_save`` for ``state``; True for the overlap mode."""
    if async_save not in (False, True, "overlap"):
        raise ValueError(f"async_save must be False, True or 'overlap', got {async_save!r}")
    if async_save == "overlap" and not state.optimizers:
        raise ValueError(
            "async_save='overlap' needs optimizer= (or an optimizer in the TrainingState), "
            "whose step() waits for the snapshot"
        )
    return async_save == "overlap"


@dataclass
class _Staged:
    """The host copies of a saver's last staging, for another saver of the same snapshot."""

    snapshot: Snapshot  # held: the ids below stay those of its tensors
    copies: dict[int, torch.Tensor]  # by id() of the source tensor
    fence: Fence


class AsyncSaver:
    """The staging pool, background persister and optimizer fences of one stream of saves.

    The methods that settle a previous save's failure (:meth:`raise_unseen`) belong inside
    a step of a collective call, so that every rank raises together; the others are local.
    """

    def __init__(self, lends: bool = False) -> None:
        self.lends = lends  # whether another saver may borrow this one's copies
        self.pool = StagingPool()
        self.persister = Persister()
        self._fences: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Fence]] = (
            weakref.WeakKeyDictionary()
        )
        self._eager: set[str] = set()  # deferred once, and seen written meanwhile
        self._staged: _Staged | None = None  # the last staging, until a borrower takes it
        self._borrowers: list[AsyncSaver] = []  # savers whose writes may read this pool
        self._copying: Fence | None = None  # the last staging's fence, until it is waited on
        with _LIVE_LOCK:
            _LIVE.add(self)

    def wait_for_copies(self) -> None:
        """Local: block until the host copies of this saver's last save have landed (its
        write may go on), so that the live tensors may be written; raises nothing (a failed
        copy is the save's failure, reported by the save)."""
        fence, self._copying = self._copying, None
        if fence is not None:
            fence.outcome()  # a failed copy is the save's failure: the save reports it

    @property
    def latest(self) -> Completion | None:
        """The outcome of the most recently started save, if any."""
        return self.persister.latest

    def join(self) -> None:
        """Block until the save in flight is done; local, raises nothing."""
        self.persister.join()

    def raise_unseen(self) -> None:
        """Raise the last save's error if this rank was not given it yet (see
        :meth:`Persister.raise_unseen`); call it inside a collective step."""
        self.persister.raise_unseen()

    def outcome(self) -> BaseException | None:
        """Wait for the save in flight; the last save's error or ``None``; local."""
        return self.persister.outcome()

    def reserve(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Size the host buffer for ``tensors`` ahead of the first save, on a helper
        thread (see :meth:`StagingPool.reserve`)."""
        return self.pool.reserve(tensors)

    def release(self) -> None:
        """Wait for the save in flight (and borrowers' writes), then free the host buffer;
        local."""
        self._join_borrowers()
        self.persister.join()
        self._staged = None
        self.pool.release()

    def _join_borrowers(self) -> None:
        """Wait for the writes of savers that read this pool's copies (see :meth:`start`)."""
        for borrower in self._borrowers:
            borrower.join()
        self._borrowers = []

    def start(
        self,
        plan: WritePlan,
        snapshot: Snapshot,
        *,
        overlap: bool,
        persist: Callable[[WritePlan], object] = write_and_commit,
        borrow: AsyncSaver | None = None,
    ) -> Completion:
        """Stage ``plan``'s tensors and persist them in the background; closes ``plan.comm``.

        Call :meth:`join` before: the pool's previous copies must be written. With
        ``overlap`` the tensors that only known optimizers' ``step()`` writes (parameters
        and moments of the save's optimizers, ``snapshot.stepped_by``) are copied in the
        background too, and each of those optimizers' next ``step()`` waits for the copies;
        everything else (buffers, an EMA copy, parameters no known optimizer steps, those a
        module's forward writes, an ``nn.Embedding`` with ``max_norm``, and tensors an
        earlier save saw written before their copy landed) is copied before returning. A deferred tensor written anyway is
        copied again, with a WARNING (:meth:`_written`). With ``borrow``, a saver whose last :meth:`start` staged
        this same ``snapshot``, the tensors it copied are read from its copies instead of
        copied again. Returns the save's completion.
        """
        comm = plan.comm  # a failure here or in the job reaches every rank at once
        lent = borrow._lend(snapshot, self) if borrow is not None else None
        copies = lent.copies if lent is not None else {}
        deferred = self._deferrable(snapshot) if overlap else None
        steppers = {
            id(o): o
            for n, t in plan.items + plan.checked
            if deferred and deferred(n) and id(t) not in copies
            for o in snapshot.stepped_by[n]
        }
        parts = (len(plan.items), len(plan.checked))
        everything = plan.items + plan.checked + plan.rank_items
        own = [(n, t) for n, t in everything if id(t) not in copies]
        self._join_borrowers()  # their writes may still read the pool staged into now
        on_written = functools.partial(self._written, os.path.basename(plan.path))
        copied, fence = comm.alone(lambda: self.pool.stage(own, deferred, on_written))
        self._copying = fence
        if self.lends:
            by_source = {id(t): c for (_, t), (_, c) in zip(own, copied, strict=True)}
            self._staged = _Staged(snapshot, by_source, fence)
        mine = iter(copied)
        staged = [(n, copies[id(t)]) if id(t) in copies else next(mine) for n, t in everything]
        plan.items, plan.checked = staged[: parts[0]], staged[parts[0] : sum(parts)]
        plan.rank_items = staged[sum(parts) :]
        for stepper in steppers.values():
            self._fence_before_step(stepper, fence)
        fences = [fence] if lent is None else [lent.fence, fence]

        def job() -> None:
            try:
                for each in fences:
                    comm.alone(each.wait)
                persist(plan)
            except BaseException as exc:
                comm.close(exc)
                raise
            comm.close()

        context = contextvars.copy_context()  # the save call's (ddpckpt.events times it)
        return self.persister.submit(lambda: context.run(job), os.path.basename(plan.path))

    def _lend(self, snapshot: Snapshot, borrower: AsyncSaver) -> _Staged | None:
        """This saver's last staging if it was of ``snapshot`` (handed out once); its pool
        is then not staged into again before ``borrower``'s write in flight is done."""
        staged, self._staged = self._staged, None
        if staged is None or staged.snapshot is not snapshot:
            return None
        if borrower not in self._borrowers:
            self._borrowers.append(borrower)
        return staged

    def _deferrable(self, snapshot: Snapshot) -> Callable[[str], bool]:
        """The tensors whose copy may wait for the next ``step()`` of the optimizers that
        write them: those nothing else is known to write (a module's forward,
        ``snapshot.written_in_forward``) or was seen writing (see :meth:`_written`)."""
        eager = snapshot.written_in_forward | self._eager
        return lambda name: bool(snapshot.stepped_by.get(name)) and name not in eager

    def _written(self, checkpoint: str, names: list[str]) -> None:
        """Called once the copies of a save landed, with the deferred tensors that were
        written before their copy did (copied again since): warn, and copy them before
        ``save()`` returns from now on."""
        self._eager.update(names)
        shown = ", ".join(sorted(names)[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else ""
        )
        _log.warning(
            "%s: %d tensor(s) were written in place after save() returned and before their "
            "copy for async_save='overlap' was taken, by something other than "
            "optimizer.step() (which waits for the copy): %s. The checkpoint holds their "
            "values after that write (never a mix), so a resume from it is not exact at its "
            "step. From the next save on, this saver copies them before save() returns. "
            "Write them only before save() or in optimizer.step(), or use async_save=True, "
            "to keep every checkpoint exact",
            checkpoint,
            len(names),
            shown,
        )

    def _fence_before_step(self, optimizer: torch.optim.Optimizer, fence: Fence) -> None:
        """Make ``optimizer.step()`` wait for ``fence`` (a hook registered once per
        optimizer and saver)."""
        if optimizer not in self._fences:
            pending: list[Fence] = []
            self._fences[optimizer] = pending

            def wait_for_snapshot(*_: object) -> None:
                while pending:
                    pending.pop().wait()

            optimizer.register_step_pre_hook(wait_for_snapshot)
        self._fences[optimizer].append(fence)


_LIVE: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def wait_for_live_copies() -> None:
    """Local: block until every live saver of this process (the default one and every
    Checkpointer's) has finished copying the tensors of its last save, so that a call
    that writes into live objects (a load, say to roll back after a loss spike) cannot
    change what a save in flight is still copying. Cheap when nothing is in flight."""
    with _LIVE_LOCK:
        savers = list(_LIVE)
    for saver in savers:
        saver.wait_for_copies()


DEFAULT_SAVER = AsyncSaver()
"""The saver of :func:`ddpckpt.save`; :func:`ddpckpt.release_async_buffers` frees its buffer."""
