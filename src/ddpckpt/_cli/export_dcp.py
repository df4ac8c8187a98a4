"""``ddpckpt export CHECKPOINT OUT --format dcp``: a checkpoint as a
``torch.distributed.checkpoint`` (DCP) directory, for DCP-based tools (DCP's own
``dcp.load``).

The directory holds what ``dcp.load`` reads into ``{"model": model_state, "optim":
optim_state}`` of ``get_state_dict(model, optimizer)``: the model's weights under their
canonical keys, and (when the checkpoint has one optimizer keyed by parameter name) its state
and param groups keyed as ``get_state_dict`` keys them. One data file, ``__0_0.distcp``, holds
every item as DCP writes it (a ``torch.save`` of each tensor, of each other value), and
``.metadata`` says where, written with DCP's own classes.

Local, one process. The tensors are read one at a time (a sharded one assembled from its
pieces), written and dropped; the checkpoint is verified as it is read. The output is
written under a temporary name and renamed into place once complete.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ddpckpt._cli.export import put_in_place
from ddpckpt._cli.tools import open_manifest
from ddpckpt._format.codec import TensorRef, decode_refs
from ddpckpt._format.sections import OptimizerSection, StateSections
from ddpckpt._io.reader import FileSource, chosen_model
from ddpckpt.errors import UnsupportedValueError
from ddpckpt.storage._layout import new_token, temp_name
from ddpckpt.storage._location import locate

DATA_FILE = "__0_0.distcp"
MODEL_KEY, OPTIMIZER_KEY = "model", "optim"


@dataclass(frozen=True)
class _Written:
    path: tuple[str | int, ...]
    offset: int
    length: int
    tensor: torch.Tensor | None  # its dtype and shape; None for a value stored as bytes


def export_dcp(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    model: str | None = None,
) -> str:
    """Write the checkpoint at ``path`` as a DCP directory ``out`` (see the module); local.
    Returns ``out``.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is not set.
        ValueError: ``out`` is not a local path.
        UnsupportedValueError: The optimizer's state cannot be keyed as DCP keys it (it was
            imported from a file keying it by position, or is a ZeroRedundancyOptimizer's).
        CheckpointError: The checkpoint is missing or damaged.
    """
    path, out = os.fspath(path), os.fspath(out).rstrip("/")
    if "://" in out:
        raise ValueError(f"{out}: DCP directories are written to a local path")
    location = locate(path)
    manifest = open_manifest(location)
    stored = StateSections.from_json(manifest.state, path)
    name = chosen_model(path, stored, model)
    optimizer = _optimizer(path, stored)
    store = locate(out).storage
    if store.exists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    source = FileSource(location, manifest)
    tmp = temp_name(out, new_token())
    os.makedirs(tmp)
    try:
        written: dict[str, _Written] = {}
        with open(os.path.join(tmp, DATA_FILE), "wb") as data:
            section = stored.models[name]
            prefix = stored.layout.model_prefix(name)
            keys = {key: key for key in section.keys} | dict(section.aliases)
            for key, stored_key in keys.items():
                tensor = _read(source, prefix + stored_key)
                _item(data, written, (MODEL_KEY, key), tensor)
            if optimizer is not None:
                _optimizer_items(data, written, source, optimizer, path)
            data.flush()
            os.fsync(data.fileno())
        with open(os.path.join(tmp, ".metadata"), "wb") as meta:
            pickle.dump(_metadata(written), meta)
            meta.flush()
            os.fsync(meta.fileno())
        put_in_place(store, tmp, out, directory=True)
    finally:
        if store.exists(tmp):
            store.delete_tree(tmp)
    return out


def _optimizer(path: str, stored: StateSections) -> OptimizerSection | None:
    if not stored.optimizers:
        return None
    if len(stored.optimizers) > 1:
        raise UnsupportedValueError(
            f"{path}: holds {len(stored.optimizers)} optimizers; DCP's get_state_dict keys one"
        )
    (section,) = stored.optimizers.values()
    if section.by_position or section.zero is not None:
        why = "imported keyed by position" if section.by_position else "a ZeroRedundancyOptimizer's"
        raise UnsupportedValueError(
            f"{path}: its optimizer state is {why}: DCP keys optimizer state by parameter name; "
            "load it into your optimizer and save once with ddpckpt, then export"
        )
    return section


def _read(source: FileSource, name: str) -> torch.Tensor:
    dtype, shape = source.meta(name)
    return source.get(name, like=torch.empty(shape, dtype=dtype))


def _item(
    data: BinaryIO, written: dict[str, _Written], path: tuple[str | int, ...], value: Any
) -> None:
    offset = data.tell()
    torch.save(value, data)
    key = ".".join(map(str, path))
    tensor = value if isinstance(value, torch.Tensor) else None
    written[key] = _Written(path, offset, data.tell() - offset, tensor)


def _optimizer_items(
    data: BinaryIO,
    written: dict[str, _Written],
    source: FileSource,
    section: OptimizerSection,
    path: str,
) -> None:
    """The optimizer as get_state_dict keys it: ``state.<param>.<key>`` and
    ``param_groups.<i>.<key>`` (``params`` listing the parameters' names)."""
    array = lambda name: _read(source, name).numpy()  # noqa: E731
    state = decode_refs(section.state, array, where=path)
    for param, values in state.items():
        for key, value in values.items():
            if isinstance(value, TensorRef):
                value = _read(source, str(value))
            _item(data, written, (OPTIMIZER_KEY, "state", param, key), value)
    for g, group in enumerate(section.groups):
        hyper = decode_refs(group.hyper, array, where=path)
        for key, value in {**hyper, "params": list(group.params)}.items():
            if isinstance(value, TensorRef):
                value = _read(source, str(value))
            _item(data, written, (OPTIMIZER_KEY, "param_groups", g, key), value)


def _metadata(written: dict[str, _Written]) -> Any:
    """DCP's Metadata for the items written (DCP's own classes: this is the writer)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    described: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, item in written.items():
        info = _StorageInfo(DATA_FILE, item.offset, item.length)
        if item.tensor is None:
            described[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = info
            continue
        size = item.tensor.shape
        start = torch.Size([0] * len(size))
        described[key] = TensorStorageMetadata(
            TensorProperties.create_from_tensor(item.tensor),
            size,
            [ChunkStorageMetadata(offsets=start, sizes=size)],
        )
        storage[MetadataIndex(key, start)] = info
    return Metadata(
        state_dict_metadata=described,
        planner_data={key: item.path for key, item in written.items()},
        storage_data=storage,
        version="1.0.0",
    )
