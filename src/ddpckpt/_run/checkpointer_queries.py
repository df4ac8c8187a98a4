"""A :class:`~ddpckpt.Checkpointer`'s queries of its run directory: local and read-only (no
lock, no collective; :mod:`ddpckpt._run.query` does the reading), so any rank or process may
ask at any time, also while a save is in flight."""

from __future__ import annotations

from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._run import query as _query
from ddpckpt._run.options import CheckpointerOptions
from ddpckpt.storage._location import Location


class RunQueries:
    """The queries of :class:`~ddpckpt.Checkpointer` (its base class)."""

    directory: str
    _location: Location  # the directory, resolved once
    options: CheckpointerOptions

    def steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first; local and read-only."""
        return _query.steps(self._location)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``; local and read-only.

        The one way to ask inside a run with a Checkpointer; :func:`ddpckpt.latest` answers
        with a path for code without one.
        """
        return _query.latest_step(self._location)

    def best(self, metric: str, mode: str | None = None) -> int | None:
        """The committed step with the best finite ``metric``; local and read-only.

        Args:
            metric: The name of a metric passed to :meth:`save`.
            mode: ``"min"`` or ``"max"``: which direction is better (default: the
                Checkpointer's ``mode``). Ties go to the newer step.

        Returns:
            The step, or ``None`` when no committed checkpoint has a finite ``metric``.

        Raises:
            TypeError: ``metric`` is not a string.
            ValueError: ``mode`` is neither ``"min"`` nor ``"max"``.
        """
        return _query.best_step(self._location, metric, mode or self.options.keeping.mode)

    def info(self, step: int) -> CheckpointInfo:
        """The metadata of checkpoint ``step`` without loading it; local and read-only.

        Raises:
            CheckpointNotFoundError: The run has no committed checkpoint ``step``.
            CorruptCheckpointError: Its manifest is damaged.
        """
        return _query.info(self._location, step)

    def resume_step(
        self, step: int | None = None, *, best: str | None = None, mode: str | None = None
    ) -> int | None:
        """The checkpoint :meth:`resume` with these arguments would load first; local and
        read-only (it loads and verifies nothing: :meth:`resume` falls back to the next
        candidate if the data does not verify).

        Args:
            step: As for :meth:`resume`: this step only.
            best: As for :meth:`resume`: the best by this metric.
            mode: ``"min"`` or ``"max"`` for ``best`` (default: the Checkpointer's).

        Returns:
            The step, or ``None`` when the run has no committed checkpoint.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed, or checkpoints exist but
                none has a finite ``best`` metric.
            ValueError: Both ``step`` and ``best`` are given.
            TypeError: ``step`` is not an int.
        """
        return _query.resume_step(self._location, step, best, mode or self.options.keeping.mode)
