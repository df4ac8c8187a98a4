"""What a run directory holds, read without side effects.

Every function here only reads: it takes no lock, creates no directory, writes nothing
and runs no collective, so any process may call it (an evaluation job, a notebook, the
CLI, one rank of a job) without ``torch.distributed``, also while a job saves into the
directory. A directory that does not exist holds no checkpoint. ``Checkpointer``'s queries
(``steps()``, ``latest_step()``, ``best()``, ``info()``, ``resume_step()``) call these.

Committed means the manifest is in place and verifies; the data is verified when loaded
(or by :func:`ddpckpt.verify`).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

from ddpckpt._format.manifest import read_manifest
from ddpckpt._format.runfiles import read_latest, read_retention, step_dirname
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._run.rundir import Entry, scan
from ddpckpt.errors import CheckpointNotFoundError
from ddpckpt.policies import Record, _best_first, _retention_from
from ddpckpt.storage._location import Location

Metrics = dict[str, Any]


def entries(directory: Location) -> list[Entry]:
    """Every ``step-N`` checkpoint, oldest first, with its status (``committed``,
    ``incomplete`` or ``corrupt``) and, when committed, its manifest."""
    return scan(directory)


def latest_name(directory: Location) -> str | None:
    """What the run's ``latest`` file names (``step-N``), or ``None``."""
    return read_latest(directory)


def why_kept(directory: Location) -> dict[int, str]:
    """The committed steps the run's retention keeps for a reason worth showing (``"best #1
    by loss"``), from the policy the saving job recorded in ``run.json``."""
    policy = _retention_from(read_retention(directory))
    if policy is None:
        return {}
    return policy.why_kept([Record(step, m) for step, m in committed(directory).items()])


def committed(directory: Location) -> dict[int, Metrics]:
    """The committed checkpoints of the run in ``directory``: their metrics, by step."""
    return {e.step: e.metrics for e in scan(directory) if e.status == "committed"}


def steps(directory: Location) -> list[int]:
    """The steps of the committed checkpoints, oldest first."""
    return sorted(committed(directory))


def latest_step(directory: Location) -> int | None:
    """The newest committed step, or ``None``."""
    return max(committed(directory), default=None)


def best_step(directory: Location, metric: str, mode: str = "min") -> int | None:
    """The committed step with the best finite ``metric`` (``mode`` ``"min"`` or ``"max"``;
    ties go to the newer), or ``None``."""
    if not isinstance(metric, str):
        raise TypeError(f"the metric is named by a string, got {metric!r}")
    ranked = _best_first(committed(directory), metric, mode)
    return ranked[0] if ranked else None


def info(directory: Location, step: int) -> CheckpointInfo:
    """The metadata of checkpoint ``step`` (epoch, metrics, world size, when saved) without
    loading it. Raises :class:`CheckpointNotFoundError` or :class:`CorruptCheckpointError`."""
    location = directory.join(step_dirname(_as_step(step)))
    return CheckpointInfo.from_manifest(location.path, read_manifest(location), {})


def choose(
    directory: str,
    found: Mapping[int, Mapping[str, Any]],
    step: int | None = None,
    best: str | None = None,
    mode: str = "min",
) -> list[int]:
    """The committed steps (``found``: metrics by step) to try loading, in order.

    With ``step``, that one (raises :class:`CheckpointNotFoundError` if it is not
    committed); with ``best``, the steps with a finite value of that metric, best first
    (raises if checkpoints exist but none has it); otherwise every step, newest first.
    """
    if step is not None and best is not None:
        raise ValueError("pass step= or best=, not both")
    if step is not None:
        step = _as_step(step)
        if step not in found:
            raise CheckpointNotFoundError(
                f"{os.path.join(directory, step_dirname(step))}: no committed checkpoint for "
                f"step {step}"
            )
        return [step]
    if best is None:
        return sorted(found, reverse=True)
    ranked = _best_first(found, best, mode)
    if found and not ranked:
        raise CheckpointNotFoundError(
            f"{directory}: no checkpoint has a finite metric {best!r} (saved with "
            f"metrics={{{best!r}: ...}}); resume() without best= loads the newest"
        )
    return ranked


def resume_step(
    directory: Location, step: int | None = None, best: str | None = None, mode: str = "min"
) -> int | None:
    """The checkpoint ``resume(step=, best=, mode=)`` would load first, or ``None`` when the
    directory holds no committed checkpoint. ``resume()`` verifies the data as it loads and
    falls back to the next candidate (see :func:`choose`) if this one is damaged."""
    candidates = choose(directory.path, committed(directory), step, best, mode)
    return candidates[0] if candidates else None


def _as_step(step: object) -> int:
    """``step`` as the int it must be (a numpy integer is one too)."""
    try:
        return operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"step must be an int, got {step!r}") from None
