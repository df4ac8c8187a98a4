"""A checkpoint of one nested dict, written and read by a single process.

What a framework's checkpoint plug-in sits on: a Lightning ``CheckpointIO``
(``save_checkpoint(checkpoint, path)`` on global rank 0, ``load_checkpoint(path,
map_location)`` on every rank, ``remove_checkpoint(path)``) or an HF ``Trainer`` callback.
:func:`save_dict`, :func:`load_dict` and :func:`remove_checkpoint` are local: any one
process calls them alone, with no collective and no process group needed. The dict's
tensors and plain values are stored as every ddpckpt checkpoint is: without pickle,
checksummed, committed atomically, verified while read.

For a DDP job's whole training state saved by every rank, use :func:`ddpckpt.save`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch

from ddpckpt import _observe, events
from ddpckpt._coord.comm import Comm
from ddpckpt._format.codec import decode, encode
from ddpckpt._format.manifest import MANIFEST_NAME, read_manifest
from ddpckpt._format.sections import DictSection, StateSections
from ddpckpt._format.statelayout import DICT_KEY
from ddpckpt._io.planning import plan_write
from ddpckpt._io.reader import FileSource
from ddpckpt._io.writing import header_fields, write_and_commit
from ddpckpt._observe import Access
from ddpckpt._state.snapshot import Snapshot
from ddpckpt.errors import CheckpointNotFoundError, StateMismatchError
from ddpckpt.storage._location import locate

MapLocation = Union[  # noqa: UP007 (a runtime alias)
    None,
    str,
    torch.device,
    Mapping[str, str],
    Callable[[torch.Tensor, str], torch.Tensor],
]


@events.timed_save
def save_dict(
    path: str | os.PathLike[str],
    checkpoint: Mapping[str, Any],
    *,
    step: int | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Write one process's nested dict as the checkpoint directory ``path``; local.

    One process calls it, alone (not collective): a framework plug-in's checkpoint dict,
    an evaluation's results. For a DDP job's training state use :func:`ddpckpt.save`.

    Args:
        path: The checkpoint directory (or URL) to create.
        checkpoint: Nested dicts, lists and tuples of tensors (on any device) and plain
            values: everything :func:`ddpckpt.save` stores as an ``extra`` value (numbers,
            strings, containers, ``OrderedDict``, numpy arrays ...).
        step: Recorded in the manifest, where :func:`ddpckpt.latest` and the command line
            find it.
        epoch: Recorded in the manifest.
        metrics: Scalars recorded in the manifest.
        overwrite: Replace a checkpoint already at ``path``, atomically.

    Returns:
        The checkpoint's path.

    Raises:
        UnsupportedValueError: A value (a dict subclass, an arbitrary object) cannot be
            stored without pickle; names its key, before anything is written.
        CheckpointExistsError: ``path`` is already a checkpoint and ``overwrite`` is false.
        CheckpointWriteError: Storage failed.
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"save_dict takes a mapping, got {type(checkpoint).__qualname__}")
    snapshot = Snapshot()
    tree = encode(dict(checkpoint), DICT_KEY, snapshot.tensors)
    devices = {n: str(t.device) for n, t in snapshot.tensors.items() if t.device.type != "cpu"}
    snapshot.state = StateSections(saved_dict=DictSection(tree, devices)).to_json()
    snapshot.balanced.update(snapshot.tensors)
    location = locate(_observe.place(path, "save_dict", Access.WRITE))
    comm = Comm.local("ddpckpt.save_dict", location.path)
    header = header_fields(step, epoch, metrics)
    plan = plan_write(comm, location, snapshot, header, overwrite=overwrite, storage="shared")
    return write_and_commit(plan)


def load_dict(path: str | os.PathLike[str], map_location: MapLocation = "cpu") -> dict[str, Any]:
    """The dict :func:`save_dict` wrote at ``path``, every tensor verified; local.

    Tensors are private copies; numpy arrays stay numpy arrays.

    Args:
        path: A checkpoint directory (or URL) written by :func:`save_dict`.
        map_location: Where tensors go, as for ``torch.load``: a device (``"cpu"``, the
            default, or ``"cuda:1"``, ``torch.device(...)``) for every tensor; ``None`` for
            the device each was saved from; a dict from saved device to device
            (``{"cuda:0": "cuda:1"}``; others stay where they were saved); or a function
            ``(tensor, saved device) -> tensor`` given each tensor on the CPU (``None``
            back keeps the saved device).

    Returns:
        The nested dict as saved.

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        CorruptCheckpointError: A file does not match its checksum (names it).
        StateMismatchError: ``path`` is a checkpoint of a training state (load those with
            :func:`ddpckpt.load` or :func:`ddpckpt.load_state_dict`).
        RuntimeError: A device this machine lacks.
    """
    path = _observe.place(path, "load_dict", Access.READ)
    location = locate(path)
    manifest = read_manifest(location)
    section = StateSections.from_json(manifest.state, path).saved_dict
    if section is None:
        raise StateMismatchError(
            f"{path}: holds a training state saved by ddpckpt.save, not a dict saved by "
            "save_dict; load it with ddpckpt.load(path, ...) or ddpckpt.load_state_dict(path)"
        )
    source = FileSource(location, manifest)
    devices = section.devices
    arrays = _array_names(section.tree)

    def tensor(name: str) -> torch.Tensor:
        if name in arrays:  # a numpy array stays one, in host memory (as torch.load keeps it)
            return source.get(name).clone()
        saved = devices.get(name, "cpu")
        if callable(map_location):
            moved = map_location(source.get(name).clone(), saved)
            if moved is not None:  # as for torch.load, None keeps the saved device
                return moved
            return _read(source, name, torch.device(saved), path)
        return _read(source, name, _target(map_location, saved), path)

    return decode(section.tree, tensor, where=path)


def _read(source: FileSource, name: str, target: torch.device, path: str) -> torch.Tensor:
    """A private copy of the stored tensor ``name`` on ``target``."""
    if target.type == "cpu":
        return source.get(name).clone()
    backend = getattr(torch, target.type, None)
    if not getattr(backend, "is_available", lambda: True)():
        raise RuntimeError(
            f"{path}: tensor {name.removeprefix(DICT_KEY + '/')!r} would go to {target}, which this machine does not have; "
            "pass map_location='cpu' (or a device it has)"
        )
    dtype, shape = source.meta(name)
    into = torch.empty(shape, dtype=dtype, device=target)
    got = source.get(name, like=into)
    return into if got is into else into.copy_(got)


def _array_names(tree: Any) -> set[str]:
    """The stored names of the numpy arrays in an encoded tree."""
    if isinstance(tree, list):
        return set().union(*(_array_names(v) for v in tree))
    if not isinstance(tree, dict):
        return set()
    if len(tree) == 1 and isinstance(tree.get("$ndarray"), str):
        return {tree["$ndarray"]}
    return set().union(*(_array_names(v) for v in tree.values()))


def _target(map_location: MapLocation, saved: str) -> torch.device:
    """The device a tensor saved from ``saved`` goes to."""
    if map_location is None:
        return torch.device(saved)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, Mapping):
        return torch.device(map_location.get(saved, saved))
    raise TypeError(
        "map_location must be None, a device, a dict of devices or a function, got "
        f"{type(map_location).__qualname__}"
    )


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the committed checkpoint at ``path``; local.

    A crash midway never leaves a checkpoint that looks complete: on a file system the
    directory is first renamed away (atomic), on an object store its manifest is deleted
    first. One process calls it (under ``torch.distributed``, rank 0 only, then a barrier
    if other ranks read the directory next).

    Args:
        path: A committed checkpoint directory (or URL).

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint; nothing is deleted
            then (never a directory that is not a checkpoint).
    """
    path = _observe.place(path, "remove_checkpoint", Access.WRITE)
    store = locate(path).storage
    if not store.exists(os.path.join(path, MANIFEST_NAME)):
        raise CheckpointNotFoundError(f"{path}: no committed checkpoint here; nothing removed")
    store.commit.discard(store, path)
