"""Every exception ddpckpt raises.

Each class subclasses the built-in a caller would naturally catch (``FileNotFoundError`` for
a missing checkpoint, ``TimeoutError`` for a rank that never arrived, ...) and
:class:`CheckpointError`, so ``except ddpckpt.CheckpointError`` catches them all.

Under ``torch.distributed`` a failure on any rank is re-raised on *every* rank with the
same message; :attr:`CheckpointError.failures` then maps each failing rank to what went
wrong there, and on the rank that failed the original exception is chained as
``__cause__`` (unless it is itself a ddpckpt error, as every rank's failure is: ``save``
then raises the combined error alone, its full traceback logged at DEBUG level).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointStepError",
    "CheckpointWriteError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InexactResumeError",
    "InsufficientSpaceError",
    "PartiallyRestoredError",
    "RankFailureError",
    "ResumeCheckRefusedError",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
]


class CheckpointError(Exception):
    """Base class of ddpckpt's errors.

    ``failures`` is empty for an error raised on one process; for an error gathered from
    several ranks it maps each failing rank to ``"ExceptionType: message"``.
    """

    failures: Mapping[int, str] = {}


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the path (or, for a run directory, none at all)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint is already committed at the path and overwriting was not asked for."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint's bytes do not match its manifest: checksum, size, header or JSON."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """A checkpoint directory lacks its manifest or one of the files the manifest lists."""


class PartiallyRestoredError(CheckpointError, RuntimeError):
    """A load failed after it had begun writing into the live objects: they hold part of a
    checkpoint's state (and part of what they held before), so training on them or saving
    them would go on from a state no checkpoint holds. The message names the checkpoint and
    says what to do: load a checkpoint into them (the previous one, say), which restores
    every object again. Until a load into them succeeds, saving them raises this error too.
    The failure that stopped the load is chained as ``__cause__``; not a
    :class:`CorruptCheckpointError`, so code that starts afresh on one never trains on
    half-restored objects."""


class CheckpointStepError(CheckpointError, ValueError):
    """A save's step is older than the newest checkpoint of the run."""


class StateMismatchError(CheckpointError, RuntimeError):
    """The live objects do not match the checkpoint: keys, shapes, param groups, sections."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value cannot be stored without pickle; the message names its key."""


class InexactResumeError(CheckpointError, ValueError):
    """The objects given would not resume at the exact position (data loading); says what to add."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A legacy ``torch.save`` file would need pickle to run code (or trusted globals) to load."""


class CheckpointWriteError(CheckpointError, OSError):
    """Storage failed while writing or committing a checkpoint (disk full, read-only, ...)."""


class InsufficientSpaceError(CheckpointWriteError):
    """The target file system has less free space than the checkpoint needs."""


class CheckpointLockedError(CheckpointError, RuntimeError):
    """Another live job holds the lock on a run directory."""


class CollectiveTimeoutError(CheckpointError, TimeoutError):
    """Some ranks did not reach a ddpckpt collective within the timeout; names them."""


class CollectiveMismatchError(CheckpointError, RuntimeError):
    """Ranks called different ddpckpt collectives (e.g. ``save`` on rank 0, ``load`` on rank 1)."""


class RankFailureError(CheckpointError, RuntimeError):
    """Ranks failed with different kinds of errors; ``failures`` has each rank's."""


class ResumeCheckRefusedError(CheckpointError, RuntimeError):
    """Under ``ddpckpt check-resume``: a call of the script that would read the user's own
    run for resuming, or write outside the check's directory; says which call and why."""


def error_class(name: str) -> type[CheckpointError]:
    """Return the ddpckpt error class called ``name``, or :class:`RankFailureError`."""
    found = _BY_NAME.get(name)
    return found if found is not None else RankFailureError


_BY_NAME: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointExistsError,
        CheckpointLockedError,
        CheckpointNotFoundError,
        CheckpointStepError,
        CheckpointWriteError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        CorruptCheckpointError,
        IncompleteCheckpointError,
        InexactResumeError,
        InsufficientSpaceError,
        PartiallyRestoredError,
        RankFailureError,
        ResumeCheckRefusedError,
        StateMismatchError,
        UnsafeCheckpointError,
        UnsupportedValueError,
    )
}
