"""Ray Train with ddpckpt's checkpoints: every worker writes its share of one checkpoint
straight into the run's storage, and Ray Train tracks it (a complete script: the Ray Train
page of the documentation).

Ray Train's own recipe is the folklore inside an engine: each worker ``torch.save``s into a
temporary directory (rank 0's by convention), and ``ray.train.report`` copies it to
``RunConfig(storage_path=...)``. Here, inside the training function:

* :func:`report` stands for ``ray.train.report(metrics, checkpoint=...)``: every worker calls
  it at the same steps. The whole :class:`ddpckpt.TrainingState` (every worker's random
  streams and data position too) is saved as ddpckpt saves any checkpoint, each worker
  writing its share, straight to ``<storage_path>/<name>/step-<N>`` (no temporary copy, no
  upload, no pickle, checksummed, committed atomically); then it is reported to Ray Train,
  which records it, attaches rank 0's metrics and applies ``CheckpointConfig(num_to_keep)``.
* a DataLoader from ``ray.train.torch.prepare_data_loader`` in the state keeps its position
  as any DataLoader does (what training consumed; the batch Ray Train's loader holds ahead
  of training is not counted).
* :func:`resume` stands for ``ray.train.get_checkpoint()`` and loading it: every worker
  calls it before training; it loads the checkpoint Ray Train restored (after a
  ``FailureConfig(max_failures=...)`` restart of the worker group, or a run started again
  with the same ``RunConfig(name=...)``) and returns its :class:`ddpckpt.CheckpointInfo`, or
  ``None`` on a fresh start.

The run's storage is a directory every node sees (Ray Train requires one for several
nodes) or ``s3://`` (with ddpckpt's ``s3`` extra); other ``pyarrow`` file systems are
refused by name.
"""

from __future__ import annotations

from ddpckpt.integrations._require import require
from ddpckpt.storage._location import Location, locate

require("ray", "Ray Train", "ray")

import os  # noqa: E402
from typing import Any  # noqa: E402

import ray.train  # noqa: E402
from ray.train.v2.api.report_config import CheckpointUploadMode  # noqa: E402

import ddpckpt  # noqa: E402
from ddpckpt._coord.comm import Comm  # noqa: E402
from ddpckpt._format.runfiles import step_dirname  # noqa: E402
from ddpckpt._log import get_logger  # noqa: E402
from ddpckpt._run.catalog import load_first  # noqa: E402
from ddpckpt._run.rundir import clean_temporaries, scan  # noqa: E402
from ddpckpt._training.loader import register_wrapper  # noqa: E402

__all__ = ["report", "resume"]

_log = get_logger(__name__)
_newest: dict[str, int] = {}  # per run directory: the newest step saved or resumed from
_recorded: dict[str, int] = {}  # per run: a damaged step Ray Train recorded, fallen back past

try:  # what ray.train.torch.prepare_data_loader returns (else ddpckpt refuses it, by name)
    from ray.train.torch.train_loop_utils import _WrappedDataLoader
except ImportError:  # pragma: no cover - another Ray: its loader is refused, not mistracked
    pass
else:  # it iterates the DataLoader in ``_dataloader``, holding the next batch in ``next_batch``
    register_wrapper(_WrappedDataLoader, "_dataloader", "next_batch")


def report(
    metrics: dict[str, Any],
    state: ddpckpt.TrainingState,
    *,
    step: int,
    epoch: int | None = None,
) -> str:
    """Save ``state`` as this run's checkpoint ``step`` and report it to Ray Train with
    ``metrics``; every worker of the training function calls it, at the same steps (as
    ``ray.train.report``, which it calls last). Returns the checkpoint's location.

    The checkpoint is ``<storage_path>/<name>/step-<N>``, written by every worker. A
    ``step-<N>`` already there is one the run went back from, and is replaced: one Ray
    Train never recorded (the worker group failed before it did), or the damaged one
    Ray Train restored and :func:`resume` fell back past. Ray Train's record of that one
    names this path, so that report records no second checkpoint (metrics only).

    Args:
        metrics: What ``ray.train.report`` takes (rank 0's are kept with the checkpoint).
        state: The training state (``ddpckpt.TrainingState(model=..., optimizer=...)``).
        step: The training step, also the checkpoint's name.
        epoch: The epoch, saved with it (:func:`resume` returns it).

    Raises:
        ValueError: The run's storage is neither a file system path nor ``s3://``, or
            ``step`` is not newer than the run's newest (saved, or resumed from).
        CheckpointError: As :func:`ddpckpt.save` raises, on every worker.
    """
    filesystem, run = _storage()
    newest = _newest.get(run)
    if newest is not None and step <= newest:
        raise ValueError(
            f"report(step={step}): this run already has step {newest} (saved, or resumed "
            "from); each report must save a newer step. Ray Train would record two "
            "checkpoints at one path, and its num_to_keep could delete the newer one's files"
        )
    location = _location(filesystem, f"{run}/{step_dirname(step)}")
    ddpckpt.save(location, state, step=step, epoch=epoch, overwrite=True)
    _newest[run] = step
    if _recorded.get(run) == step:  # Ray Train's record of the damaged one names this path
        _log.info("%s: saved again in place of the damaged one Ray Train recorded", location)
        ray.train.report(metrics)  # a second record of one path: num_to_keep would delete it
        return location
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint(f"{run}/{step_dirname(step)}", filesystem),
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,  # written where it belongs
    )
    return location


def resume(state: ddpckpt.TrainingState) -> ddpckpt.CheckpointInfo | None:
    """Load the checkpoint Ray Train restored into ``state``; every worker calls it, before
    training. Returns the checkpoint's :class:`ddpckpt.CheckpointInfo` (``step``, ``epoch``),
    or ``None`` when Ray Train has none (a fresh run).

    First, world rank 0 removes what saves killed midway left in the run's storage (also
    when Ray Train restores nothing) and lists the run's checkpoints. If the restored one is damaged (a checksum fails, a file
    is missing), a WARNING says so and the next older checkpoint of the run is loaded
    instead, as :func:`ddpckpt.load_latest` falls back. A WARNING names the checkpoints
    of this run newer than the one restored and committed, but not what Ray Train
    restored (the worker group failed before Ray Train recorded it as its latest), so
    training goes back to the restored step and they are replaced as it saves those steps
    again.

    Raises:
        ValueError: The run's storage is neither a file system path nor ``s3://``.
        CorruptCheckpointError: No checkpoint of the run loads (each one's problem named).
        CheckpointError: As :func:`ddpckpt.load` raises (a checkpoint Ray Train restored
            that ddpckpt did not write is a :class:`~ddpckpt.errors.CheckpointError`).
    """
    checkpoint = ray.train.get_checkpoint()
    filesystem, experiment = _storage()
    _newest.pop(experiment, None)  # a new attempt of the run (this process may be reused)
    _recorded.pop(experiment, None)
    run = _location(filesystem, experiment)
    leader = ray.train.get_context().get_world_rank() == 0
    with Comm.open("ddpckpt.integrations.ray.resume", path=run) as comm:
        run_at = comm.locate(run)  # a worker that cannot fails the call everywhere
        comm.run("leftovers", lambda: _clean(run_at) if leader else None)
        if checkpoint is None:  # the same on every worker
            return None
        found = comm.run_reduce("list", lambda: _listing(run_at) if leader else [], lambda v: v[0])
    location = _location(checkpoint.filesystem, checkpoint.path)
    restored = os.path.basename(location.rstrip("/"))
    step = next((s for s, name, _ in found if name == restored), None)
    if leader and step is not None:
        _report_newer(location, step, found)
    older = [  # what load_first falls back to if the restored one is damaged, newest first
        run_at.join(name)
        for s, name, status in reversed(found)
        if step is not None and s < step and status == "committed"
    ]
    info = load_first(  # each one tried goes through the public load, as the user's call
        run, [locate(location), *older], "ddpckpt.integrations.ray.resume()",
        lambda place: ddpckpt.load(place.path, state),
    )  # fmt: skip
    if info is not None and info.step is not None:
        _newest[experiment] = info.step
        if step is not None and info.step != step:  # fell back past Ray Train's record
            _recorded[experiment] = step
    return info


def _storage() -> tuple[Any, str]:
    """The run's ``pyarrow`` file system and its directory on it (all of this run's
    checkpoints go there)."""
    storage = ray.train.get_context().get_storage()
    return storage.storage_filesystem, storage.experiment_fs_path


def _location(filesystem: Any, path: str) -> str:
    """``path`` on Ray Train's ``filesystem``, as ddpckpt's storage names it."""
    kind = getattr(filesystem, "type_name", type(filesystem).__name__)
    if kind == "local":
        return path
    if kind == "s3":
        return f"s3://{path.lstrip('/')}"
    raise ValueError(
        f"ddpckpt.integrations.ray writes checkpoints through ddpckpt's storage: a file "
        f"system path (shared by every node) or s3://; this run's storage is {kind!r} "
        f"({path}). Set RunConfig(storage_path=...) to one of those"
    )


def _clean(run: Location) -> None:
    """On world rank 0, with no worker saving (the group was just started): remove what
    saves killed midway left in the run's storage, and put back a checkpoint an
    interrupted overwrite had moved aside."""
    for name in clean_temporaries(run):
        _log.info("%s: removed %s, left by an interrupted save", run, name)


def _listing(run: Location) -> list[tuple[int, str, str]]:
    """On world rank 0: ``(step, name, status)`` of each of the run's checkpoints, oldest
    first (sent to every worker: a few bytes per checkpoint)."""
    return [(e.step, os.path.basename(e.path), e.status) for e in scan(run)]


def _report_newer(restored: str, step: int, found: list[tuple[int, str, str]]) -> None:
    """On world rank 0 alone: warn of the committed checkpoints newer than ``step``."""
    run = os.path.dirname(restored.rstrip("/"))
    newer = [os.path.join(run, n) for s, n, status in found if s > step and status == "committed"]
    if newer:
        _log.warning(
            "Ray Train restored %s (step %d); %s newer and committed, but not what Ray "
            "Train restored (the worker group failed before Ray Train recorded it as its "
            "latest): training goes back to step %d, and each is replaced when that step "
            "is saved again",
            restored,
            step,
            ", ".join(newer),
            step,
        )
