"""Which tiers a :class:`~ddpckpt.Checkpointer`'s save writes, decided at each step.

:meth:`SaveGate.due` is :meth:`Checkpointer.should_save <ddpckpt.Checkpointer.should_save>`:
the durable tier's schedule (rank 0's answer on every rank when the policy reads the clock
or a preemption may be pending), else the fast tier's. :meth:`SaveGate.tiers` is then what
the save at that step writes: the fast tier alone when only it was due, the durable tier
alone for a preemption's synchronous save, every tier otherwise. On steps nothing is due,
each asynchronous tier's host buffer is sized ahead of its first save, on a helper thread.
"""

from __future__ import annotations

from ddpckpt._coord.comm import Comm
from ddpckpt._log import get_logger
from ddpckpt._run.durable import DurableSaves
from ddpckpt._run.fast_tier import FastSaves
from ddpckpt._run.options import CheckpointerOptions
from ddpckpt._run.preemption import PreemptionWatch
from ddpckpt._run.tier import Tier
from ddpckpt._state.capture import capture
from ddpckpt._state.training_state import TrainingState

_log = get_logger(__name__)


class SaveGate:
    """The save schedule of one Checkpointer over its tiers (durable first); every rank
    calls :meth:`due` at the same steps, then :meth:`tiers` for the save that follows."""

    def __init__(
        self,
        state: TrainingState,
        options: CheckpointerOptions,
        durable: DurableSaves,
        fast: FastSaves | None,
        preemption: PreemptionWatch | None,
    ) -> None:
        self.state, self.options = state, options
        self.durable, self.fast, self.preemption = durable, fast, preemption
        self.all: list[Tier] = [durable] if fast is None else [durable, fast]
        self._fast_only: int | None = None  # the step due() asked the fast tier alone for
        self._reserved: list[Tier] = []  # tiers whose buffer was sized ahead of a save

    def due(self, step: int) -> bool:
        """Whether a save is due at ``step``; collective when the answer must be agreed."""
        durable = self._durable_due(step)
        fast = not durable and self.fast is not None and self.fast.due(step)
        self._fast_only = step if fast else None
        return durable or fast

    def tiers(self, step: int, synchronous: bool) -> list[Tier]:
        """The tiers the save of ``step`` writes: the fast tier alone if :meth:`due` asked
        for it alone at this step, the durable tier alone for a ``synchronous`` save (a
        preemption's: durable at once), else all."""
        fast_only, self._fast_only = self._fast_only == step and not synchronous, None
        if fast_only and self.fast is not None:
            return [self.fast]
        return [self.durable] if synchronous else self.all

    def _durable_due(self, step: int) -> bool:
        watch, saves = self.preemption, self.durable.saves
        latest = saves.latest  # with preemption on, a signal can still finish this save
        if latest is not None and (step < latest or (step == latest and watch is None)):
            return False
        if watch is not None:
            watch.announce()

        def decide() -> bytes:  # on rank 0 only when the ranks must agree
            preempt = watch.requested() if watch is not None else None
            if preempt is not None:
                return preempt
            return b"1" if self.durable.due(step) else b"0"

        if self.options.schedule.policy.needs_agreement or watch is not None:
            decision = Comm.from_leader(
                "Checkpointer.should_save", decide, timeout=self.options.storage.timeout
            )
        else:
            decision = decide()
        if decision[:1] == b"P" and watch is not None:
            watch.agree(step, decision)
            if step == saves.latest:  # the newest save holds it: finish it, no new one
                watch.run_save(saves.flush)
                return False
            return True
        if decision != b"1":
            self._reserve_staging()
        return decision == b"1"

    def _reserve_staging(self) -> None:
        """Local: once a tier's layout is known, allocate its asynchronous saves' host buffer
        on a helper thread, so that its first save does not stall on it (pinning is about
        0.5 s per GB): the durable tier's with ``async_save``, the fast tier's always (its
        saves are asynchronous; at a step both tiers save, it reads the durable's copies)."""
        due = [
            tier
            for tier in self.all
            if tier.saves.options.asynchronous.enabled
            and tier.saves.domains is not None
            and not any(tier is r for r in self._reserved)
        ]
        if not due:
            return
        self._reserved.extend(due)
        try:  # local to this rank: an error here (a node lacking a shard of the state)
            # may be this rank's alone, so only the collective save reports it
            snapshot = capture(self.state)
            for tier in due:
                if tier.saves.saver.latest is None:  # else a save sized it, may still copy
                    tier.saves.reserve(snapshot)
        except Exception as exc:
            _log.debug(
                "%s: not sizing the staging buffer ahead: %r", self.durable.saves.directory, exc
            )
