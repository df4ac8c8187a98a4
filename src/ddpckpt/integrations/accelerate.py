"""Hugging Face Accelerate with ddpckpt: an ``Accelerator``'s whole state in one ddpckpt
checkpoint (a complete script: the Accelerate page of the documentation).

:func:`save_state` and :func:`load_state` stand for ``accelerator.save_state`` and
``accelerator.load_state``: collective (every process calls them), they save and restore
the prepared models, optimizers (``AcceleratedOptimizer``), schedulers
(``AcceleratedScheduler``), the GradScaler, the objects registered with
``register_for_checkpointing``, the gradient-accumulation step counter, every process's
random streams, and the position of every prepared DataLoader: the next iteration of a
DataLoader saved inside an epoch continues after the last batch training consumed, in the
saved order (no ``skip_first_batches``; the skipped samples are never loaded). Everything
is written as ddpckpt writes any checkpoint: no pickle, checksummed, committed atomically,
each process writing a share. :func:`training_state` gives the same objects as a
:class:`ddpckpt.TrainingState`, for a :class:`ddpckpt.Checkpointer` (retention,
preemption, asynchronous saves).

Every committed checkpoint is logged with ``accelerator.log`` (``checkpoint/stall_s``,
``checkpoint/durable_s``, ``checkpoint/size_bytes``, ``checkpoint/verified``) to the
trackers the accelerator was given.
"""

from __future__ import annotations

from ddpckpt.integrations._require import require
from ddpckpt.storage._location import locate

require("accelerate", "Hugging Face Accelerate", "accelerate")

import os  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

from accelerate import Accelerator  # noqa: E402

import ddpckpt  # noqa: E402
from ddpckpt._coord.comm import Comm  # noqa: E402
from ddpckpt._format.manifest import read_manifest  # noqa: E402
from ddpckpt._format.sections import StateSections  # noqa: E402
from ddpckpt._io.background import PendingSave  # noqa: E402
from ddpckpt._log import get_logger, same_on_every_rank  # noqa: E402
from ddpckpt.errors import CheckpointError  # noqa: E402
from ddpckpt.events import SaveEvent, add_listener  # noqa: E402
from ddpckpt.integrations._prepared import PreparedLoaderPosition  # noqa: E402

__all__ = ["load_state", "save_state", "training_state"]

_log = get_logger(__name__)


class _StepCounter:
    """The accelerator's gradient-accumulation step counter, as a stateful object."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = int(state["step"])


_positions: weakref.WeakKeyDictionary[Any, PreparedLoaderPosition] = weakref.WeakKeyDictionary()
_reporting: weakref.WeakSet[Accelerator] = weakref.WeakSet()


def training_state(
    accelerator: Accelerator, *, log_checkpoints: bool = True, **extra: Any
) -> ddpckpt.TrainingState:
    """The accelerator's prepared objects as a :class:`ddpckpt.TrainingState`; local.

    Names: ``model`` (or ``model0``, ``model1`` ... for several), ``optimizer``,
    ``scheduler``, ``dataloader`` likewise, ``scaler``, ``custom0`` ... for the objects
    registered with ``register_for_checkpointing``, ``accelerator_step``; ``extra`` adds
    your own (an EMA model, a counter). Call it (or :func:`load_state`) after
    ``accelerator.prepare`` and before the training loop's first batch: each prepared
    DataLoader's position is recorded from its first batch on.

    Args:
        accelerator: The ``Accelerator`` whose prepared objects are named.
        log_checkpoints: The accelerator's main process logs each committed checkpoint
            with ``accelerator.log``.
        **extra: More objects of your own, by name.

    Returns:
        The objects, for :func:`ddpckpt.save`, :func:`ddpckpt.load` or a
        :class:`ddpckpt.Checkpointer`.
    """
    objects: dict[str, Any] = {}
    groups = {
        "model": list(accelerator._models),
        "optimizer": [getattr(o, "optimizer", o) for o in accelerator._optimizers],
        "scheduler": [getattr(s, "scheduler", s) for s in accelerator._schedulers],
        "dataloader": [_position(d, i) for i, d in enumerate(accelerator._dataloaders)],
    }
    for name, members in groups.items():
        if len(members) == 1:
            objects[name] = members[0]
        else:
            objects.update({f"{name}{i}": member for i, member in enumerate(members)})
    if accelerator.scaler is not None:
        objects["scaler"] = accelerator.scaler
    objects.update({f"custom{i}": obj for i, obj in enumerate(accelerator._custom_objects)})
    objects["accelerator_step"] = _StepCounter(accelerator)
    if log_checkpoints and accelerator.is_main_process and accelerator not in _reporting:
        _reporting.add(accelerator)
        add_listener(_logger_for(weakref.ref(accelerator)))
    return ddpckpt.TrainingState({**objects, **extra})


def save_state(
    accelerator: Accelerator,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    epoch: int | None = None,
    metrics: dict[str, Any] | None = None,
    **options: Any,
) -> str | PendingSave:
    """``accelerator.save_state`` through ddpckpt: :func:`ddpckpt.save` of
    :func:`training_state` at ``path``; collective (every process calls it).

    Args:
        accelerator: The ``Accelerator``.
        path: The checkpoint directory to write (or URL).
        step: Recorded in the manifest (what ``ddpckpt.latest`` orders by).
        epoch: Recorded in the manifest.
        metrics: Scalars recorded in the manifest.
        **options: Passed to :func:`ddpckpt.save` (``overwrite``, ``async_save``,
            ``sharing``, ``timeout`` ...).

    Returns:
        What :func:`ddpckpt.save` returns: the path, or a :class:`~ddpckpt.PendingSave`
        with ``async_save``.

    Raises:
        CheckpointError: As :func:`ddpckpt.save`, on every process.
    """
    state = training_state(accelerator)
    return ddpckpt.save(path, state, step=step, epoch=epoch, metrics=metrics, **options)


def load_state(
    accelerator: Accelerator, path: str | os.PathLike[str], **options: Any
) -> ddpckpt.CheckpointInfo:
    """``accelerator.load_state`` through ddpckpt: :func:`ddpckpt.load` of
    :func:`training_state` from ``path``; collective (every process calls it).

    Args:
        accelerator: The ``Accelerator``, after ``prepare`` and before the first batch.
        path: The checkpoint directory (or URL).
        **options: Passed to :func:`ddpckpt.load` (``strict``, ``timeout`` ...).

    A checkpoint imported from Accelerate's own ``save_state`` (``ddpckpt import``) holds no
    DataLoader position, as Accelerate saves none: the prepared DataLoaders are left as
    they are, with a warning, and the batches already trained are skipped as the
    Accelerate script did (``accelerator.skip_first_batches``).

    Returns:
        The checkpoint's :class:`ddpckpt.CheckpointInfo` (``step``, ``epoch``,
        ``metrics``).

    Raises:
        CheckpointError: As :func:`ddpckpt.load`, on every process.
    """
    state = training_state(accelerator)
    loaders = [name for name in state if name.startswith("dataloader")]
    if loaders and _imported_without_loaders(os.fspath(path), options.get("timeout")):
        _log.warning(
            "%s holds no DataLoader position (it was imported, from a format that saves "
            "none, such as Accelerate's save_state): the prepared DataLoaders start from their "
            "beginning; skip the batches already trained with accelerator.skip_first_batches, "
            "as with Accelerate's own load_state",
            os.fspath(path),
            extra=same_on_every_rank(),
        )
        state = ddpckpt.TrainingState({k: v for k, v in state.items() if k not in loaders})
    return ddpckpt.load(path, state, **options)


def _imported_without_loaders(path: str, timeout: float | None) -> bool:
    """Whether the checkpoint at ``path`` was imported (``ddpckpt import`` of a
    ``save_state``: its model is of type "imported") and holds no DataLoader position; rank
    0 reads its manifest and tells every process. A manifest rank 0 cannot read answers
    False: the load that follows reports it on every process."""

    def decide() -> bytes:
        try:
            stored = StateSections.from_json(read_manifest(locate(path)).state, path)
        except (CheckpointError, OSError):
            return b"0"
        imported = bool(stored.models) and all(m.type == "imported" for m in stored.models.values())
        loaders = any(name.startswith("dataloader") for name in stored.extra)
        return b"1" if imported and not loaders else b"0"

    return Comm.from_leader("ddpckpt.integrations.accelerate.load_state", decide,
                            timeout=timeout) == b"1"  # fmt: skip


def _position(prepared: Any, index: int) -> PreparedLoaderPosition:
    if prepared not in _positions:
        _positions[prepared] = PreparedLoaderPosition(prepared, f"prepared DataLoader {index}")
    return _positions[prepared]


def _logger_for(accelerator: weakref.ref[Accelerator]) -> Callable[[SaveEvent], None]:
    def log(event: SaveEvent) -> None:
        live = accelerator()
        if live is None:
            return
        metrics = {
            "checkpoint/stall_s": event.stall_seconds,
            "checkpoint/durable_s": event.durable_seconds,
            "checkpoint/size_bytes": event.nbytes,
            "checkpoint/verified": int(event.verified),
        }
        live.log(metrics, step=event.step)

    return log
