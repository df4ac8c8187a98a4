"""A :class:`~ddpckpt.Checkpointer`'s properties of this process's saves: where its fast
tier is, whether a preemption checkpoint was saved, the last failure. Local reads of what
this process knows (no storage, no collective), so any rank may read them at any time."""

from __future__ import annotations

from ddpckpt._run.fast_tier import FastSaves
from ddpckpt._run.preemption import PreemptionWatch
from ddpckpt._run.saving import RunSaves
from ddpckpt.errors import CheckpointError


class RunStatus:
    """The status properties of :class:`~ddpckpt.Checkpointer` (its base class)."""

    _fast: FastSaves | None
    _preemption: PreemptionWatch | None
    _saves: RunSaves  # the durable tier's saves

    @property
    def fast_tier_directory(self) -> str | None:
        """This node's fast-tier directory (``None`` without a fast tier); local. With
        ``fast_tier="auto"`` it is known once :meth:`resume` or the first :meth:`save` has
        named it for the run (``None`` before). The job that is done may delete it once every
        rank of the node has closed the Checkpointer (the fast-tier page shows how)."""
        fast = self._fast
        return fast.directory if fast is not None and fast.named else None

    @property
    def preempted(self) -> bool:
        """Whether a preemption checkpoint was saved (or failed): stop training now."""
        return self._preemption is not None and self._preemption.preempted

    @property
    def exit_code(self) -> int:
        """The process's exit code to use: ``128 + signal`` once :attr:`preempted` (143 for
        SIGTERM, as a shell reports a process that signal ended), else 0."""
        return self._preemption.exit_code if self._preemption is not None else 0

    @property
    def last_error(self) -> CheckpointError | None:
        """The error of the most recent failed save (a :class:`CheckpointWriteError`, or a
        :class:`CheckpointLockedError` once this job lost the run's lock); ``None`` once a
        save succeeds."""
        return self._saves.failures.last_error

    @property
    def failed_saves(self) -> int:
        """How many saves failed since the last one that succeeded."""
        return self._saves.failures.failed_saves
