"""The collective :func:`save`: capture, plan and write the training state.

``save`` is collective under ``torch.distributed``: every rank calls it, in the same order,
with the same arguments (rank 0's path is used everywhere); it works unchanged in a single
process. It captures the training state (:mod:`ddpckpt._state.capture`), plans and writes it
collectively (:mod:`ddpckpt._io.writing`), or from host copies in the background
(:mod:`ddpckpt._io.async_saver`). A failure on any rank raises the same error on every rank;
nothing committed earlier is touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ddpckpt import _observe, events
from ddpckpt._coord.comm import Comm
from ddpckpt._coord.failures import shorten
from ddpckpt._deprecation import renamed_argument
from ddpckpt._io.async_saver import DEFAULT_SAVER, async_mode
from ddpckpt._io.background import PendingSave
from ddpckpt._io.planning import plan_write
from ddpckpt._io.writing import header_fields, write_and_commit
from ddpckpt._observe import Access, Saved
from ddpckpt._state.capture import Snapshot, TrainingState, capture
from ddpckpt.storage._registry import configure


@events.timed_save
def save(
    path: str | os.PathLike[str],
    state: TrainingState | None = None,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: MutableMapping[str, Any] | None = None,
    step: int | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    rng: bool | None = None,
    async_save: bool | str = False,
    sharing: str | None = None,
    timeout: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
    storage: str | None = None,
) -> str | PendingSave:
    """Write the whole training state to the checkpoint directory ``path``; collective.

    Every rank calls it, with the same ``path`` and the same objects, in the same order
    as its other ddpckpt calls (a single process without ``torch.distributed`` works the
    same). What to save is a :class:`~ddpckpt.TrainingState` or its keyword shorthand
    (``model``, ``optimizer``, ``scheduler``, ``scaler``, ``extra``); pass one or the
    other. Rank 0 commits the checkpoint once every rank's files are written; a failure on
    any rank is raised on every rank.

    Args:
        path: The checkpoint directory (or an ``s3://`` / registered URL) to create.
        state: Several models, optimizers and schedulers by name.
        model: The model; may be wrapped in DDP, DataParallel or ``torch.compile``.
        optimizer: Its optimizer.
        scheduler: A learning-rate scheduler (anything with ``state_dict()``).
        scaler: A ``GradScaler``.
        extra: Names mapped to objects with ``state_dict()``/``load_state_dict()``
            (a DataLoader, an EMA, :class:`~ddpckpt.PerRank` objects) or to plain values
            (numbers, strings, lists, dicts, tensors).
        step: The training step, recorded in the manifest (what :func:`ddpckpt.latest`
            orders by).
        epoch: The epoch, recorded in the manifest.
        metrics: Scalars (numbers, 0-d tensors, strings) recorded in the manifest.
        overwrite: Replace a checkpoint already at ``path``, atomically.
        rng: Store every rank's random generators (the default).
        async_save: ``False`` writes before returning. ``True`` returns as soon as this
            rank's share of the state is copied to host memory; writing and committing go
            on in the background. ``"overlap"`` returns sooner: parameters and optimizer
            state are copied while the next forward and backward run, and the ``step()`` of
            every optimizer of the state (one at least) and in ``extra`` waits for that
            copy. Either way the checkpoint holds the state as of this call, and the next
            save or load waits for this one (raising its error if it failed and nobody
            asked its handle).
        sharing: Whether the machines of the job share ``path``'s storage: ``"auto"``
            (default: detect it), ``"shared"`` (one copy, written by all ranks) or
            ``"local"`` (node-local disks: one copy per machine).
        timeout: Seconds a rank waits for a silent one before raising
            :class:`~ddpckpt.errors.CollectiveTimeoutError`.
        storage_options: Configures an ``s3://`` URL's client (endpoint, region,
            credentials: :meth:`S3Storage.from_options <ddpckpt.storage.s3.S3Storage.from_options>`).
        storage: Deprecated spelling of ``sharing`` (warns; may be removed after
            2027-06-01).

    Returns:
        The checkpoint's path (rank 0's) for a synchronous save; for an asynchronous one a
        :class:`~ddpckpt.PendingSave` reporting this save's own outcome (``done()``,
        ``wait()``, ``exception()``).

    Raises:
        CheckpointExistsError: ``path`` is already a checkpoint and ``overwrite`` is false.
        UnsupportedValueError: Something cannot be stored without pickle (names its key).
        CheckpointWriteError: Storage failed (:class:`~ddpckpt.errors.InsufficientSpaceError`
            when the file system is too full).
        CollectiveTimeoutError: A rank did not arrive within ``timeout`` (names it).
    """
    sharing = renamed_argument("ddpckpt.save", "storage", storage, "sharing", sharing)
    configure(path, storage_options)
    path = _observe.place(path, "save", Access.WRITE)  # under check-resume: its own directory
    state = TrainingState.coerce(
        state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        extra=extra, rng=rng,
    )  # fmt: skip
    overlap = async_mode(async_save, state)
    saver = DEFAULT_SAVER
    saver.join()
    header = header_fields(step, epoch, metrics)
    comm = Comm.open("ddpckpt.save", path=os.fspath(path), timeout=timeout)

    def settle_then_capture() -> Snapshot:
        saver.raise_unseen()  # in a collective step: every rank raises if one does
        return capture(state)

    try:
        location = comm.locate(os.fspath(path))  # in the call: a failure reaches every rank
        snapshot = comm.run("capture", settle_then_capture)
        plan = plan_write(comm, location, snapshot, header, overwrite=overwrite, storage=sharing)
        if async_save:  # the background job closes the call
            saved: str | PendingSave = PendingSave(
                plan.path, saver.start(plan, snapshot, overlap=overlap)
            )
        else:
            saved = write_and_commit(plan)
    except BaseException as exc:
        comm.close(exc)  # a failure only this rank saw reaches the others at once
        if shorten(exc):  # every rank raises it: its message, not our internals
            # Not a bare raise, which would keep the whole traceback on Python 3.10.
            raise exc
        raise
    if not async_save:
        comm.close()
    _observe.tell(Saved(plan.path, state, step, epoch))
    return saved


def release_async_buffers() -> None:
    """Wait for the asynchronous save in flight, then free the host buffer that
    asynchronous :func:`ddpckpt.save` calls reuse; the next one allocates it again.

    Local: any rank may call it at any time, and it raises nothing: a failed save is raised
    by its handle and, on every rank, by the next save or load. A
    :class:`~ddpckpt.Checkpointer` has a buffer of its own, which
    :meth:`Checkpointer.close() <ddpckpt.Checkpointer.close>` frees.
    """
    DEFAULT_SAVER.release()
