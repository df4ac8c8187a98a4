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

from ddpckpt import events
from ddpckpt._coord.comm import Comm
from ddpckpt._deprecation import renamed_argument
from ddpckpt._io.async_saver import DEFAULT_SAVER, async_mode
from ddpckpt._io.background import PendingSave
from ddpckpt._io.writing import header_fields, plan_write, write_and_commit
from ddpckpt._resumecheck import isolate
from ddpckpt._resumecheck import record as _resume_check
from ddpckpt._state.capture import Snapshot, TrainingState, capture
from ddpckpt.storage import configure


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

    Every rank calls it. What to save is a :class:`TrainingState` (several models,
    optimizers, schedulers by name) or its keyword shorthand: ``model`` may be wrapped in
    DDP, DataParallel or torch.compile; ``extra`` maps names to objects with
    ``state_dict()``/``load_state_dict()`` or to plain values (numbers, strings, lists,
    dicts, tensors); with ``rng`` (default) every rank's random generators are stored.
    ``metrics`` are scalars (numbers, 0-d tensors, strings).
    ``sharing`` says whether the machines of the job share ``path``'s storage:
    ``"auto"`` (default: detect it), ``"shared"`` (one copy, written by all ranks) or
    ``"local"`` (node-local disks: one copy per machine); ``storage=`` is its deprecated
    spelling. ``timeout`` bounds how long a rank waits for a silent one.
    ``storage_options`` configures an ``s3://`` URL's client (:func:`ddpckpt.storage.configure`).

    ``async_save=True`` returns as soon as this rank's share of the state is copied to host
    memory (:mod:`ddpckpt._io.staging`); writing and committing go on in the background and the
    returned :class:`PendingSave` waits for them. ``async_save="overlap"`` returns sooner:
    parameters and optimizer state are copied while the next forward and backward run,
    and the ``step()`` of every optimizer of the state (one at least) and in ``extra``
    waits for that copy. Either way the checkpoint holds the state as of this call. The
    returned handle reports this save's own outcome (``done()``, ``wait()``,
    ``exception()``). The next save or load waits for the previous asynchronous save and
    raises its error if it failed and nobody had asked its handle.

    Raises :class:`CheckpointExistsError` if ``path`` is already a checkpoint (pass
    ``overwrite=True`` to replace it atomically), :class:`UnsupportedValueError` naming the
    key of anything that cannot be stored without pickle, :class:`CheckpointWriteError`
    when storage fails. Returns the checkpoint's path (rank 0's).
    """
    sharing = renamed_argument("ddpckpt.save", "storage", storage, "sharing", sharing)
    configure(path, storage_options)
    path = isolate.for_write(path, "save")  # under ddpckpt check-resume: its own directory
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
        snapshot = comm.run("capture", settle_then_capture)
        plan = plan_write(comm, snapshot, header, overwrite=overwrite, storage=sharing)
        if async_save:  # the background job closes the call
            saved: str | PendingSave = PendingSave(
                plan.path, saver.start(plan, snapshot, overlap=overlap)
            )
        else:
            saved = write_and_commit(plan)
    except BaseException as exc:
        comm.close(exc)  # a failure only this rank saw reaches the others at once
        raise
    if not async_save:
        comm.close()
    if (recorder := _resume_check.active()) is not None:
        recorder.saved_plain(plan.path, state, step, epoch)
    return saved


def release_async_buffers() -> None:
    """Wait for the asynchronous save in flight, then free the host buffer that
    asynchronous saves reuse; the next one allocates it again.

    Local: any rank may call it at any time, and it raises nothing: a failed save is raised
    by its handle and, on every rank, by the next save or load. A :class:`Checkpointer` has
    a buffer of its own, which :meth:`Checkpointer.close` frees.
    """
    DEFAULT_SAVER.release()
