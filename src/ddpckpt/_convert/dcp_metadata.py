"""What a DCP directory's ``.metadata`` says, checked: the records the restricted unpickler
(:mod:`ddpckpt._convert.dcp_unpickler`) gives, read field by field into typed items (each
tensor's chunks, each item's byte range of a ``.distcp`` file), walking them within a budget
of nodes in proportion to the file's size.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ddpckpt._convert.dcp_unpickler import _MAX_DIM, DTYPES, _Record, _unpickle
from ddpckpt._format.boundary import MAX_VALUE_DEPTH
from ddpckpt.errors import CorruptCheckpointError

METADATA = ".metadata"
NODES_PER_BYTE = 4  # records walked per byte of .metadata
_NODES_FLOOR = 100_000
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


@dataclass(frozen=True)
class Stored:
    """Where one item's ``torch.save`` blob lies."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: Stored


@dataclass(frozen=True)
class TensorItem:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class BytesItem:
    stored: Stored


@dataclass(frozen=True)
class DcpMetadata:
    """What ``.metadata`` says: each flattened key's item and its path in the saved dict."""

    items: dict[str, TensorItem | BytesItem]
    paths: dict[str, tuple[str | int, ...]]


class _Walk:
    """Reads typed fields out of the unpickled records, within a budget of nodes."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.left = NODES_PER_BYTE * size + _NODES_FLOOR

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: not DCP's metadata: {what}")

    def visit(self, count: int = 1) -> None:
        self.left -= count
        if self.left < 0:
            raise CorruptCheckpointError(
                f"{self.path}: its records, walked, exceed the nodes allowed for a file of its "
                "size (a pickle sharing its parts many times over); refused"
            )

    def record(self, value: Any, kind: str) -> dict[str, Any]:
        """The fields of a record of ``kind`` (a dataclass's state)."""
        self.visit()
        if not isinstance(value, _Record) or value.kind != kind:
            raise self.fail(f"a {type(value).__name__} where a {kind} belongs")
        state = value.state
        if kind == "TensorProperties":  # pickled as a tuple: dtype, layout, grad, format, pin
            if not isinstance(state, tuple) or len(state) != 5:
                raise self.fail("a TensorProperties of another form")
            return {"dtype": state[0]}
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # a dataclass with slots: (None, slot values)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise self.fail(f"a {kind} without its fields")
        return state

    def mapping(self, value: Any, what: str) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} is no dict")
        self.visit(len(value))
        return value

    def sequence(self, value: Any, what: str) -> list[Any] | tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise self.fail(f"{what} is no list")
        self.visit(len(value))
        return value

    def integer(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value < _MAX_DIM:
            raise self.fail(f"{what} is not a non-negative integer below 2**63")
        return value

    def shape(self, value: Any, what: str) -> tuple[int, ...]:
        items = self.sequence(value, what)
        if len(items) > 64:
            raise self.fail(f"{what} has {len(items)} dimensions")
        return tuple(self.integer(v, what) for v in items)


def read_metadata(directory: str) -> DcpMetadata:
    """What the DCP directory ``directory`` holds, as its ``.metadata`` says, checked."""
    path = os.path.join(directory, METADATA)
    top, size = _unpickle(path)
    walk = _Walk(path, size)
    fields = walk.record(top, "Metadata")
    described = walk.mapping(fields.get("state_dict_metadata"), "state_dict_metadata")
    planned = walk.mapping(fields.get("planner_data"), "planner_data")
    stored_by = _storage(walk, fields.get("storage_data"), directory)
    items: dict[str, TensorItem | BytesItem] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, meta in described.items():
        if not isinstance(key, str):
            raise walk.fail("a key that is not a string")
        paths[key] = _planned_path(walk, key, planned.get(key, (key,)))
        if isinstance(meta, _Record) and meta.kind == "BytesStorageMetadata":
            walk.visit()
            items[key] = BytesItem(_stored(walk, stored_by, key, None))
            continue
        tensor = walk.record(meta, "TensorStorageMetadata")
        dtype = walk.record(tensor.get("properties"), "TensorProperties")["dtype"]
        if dtype not in DTYPES.values():
            raise walk.fail(f"{key}: no dtype a checkpoint holds")
        shape = walk.shape(tensor.get("size"), f"{key}'s size")
        chunks = []
        for chunk in walk.sequence(tensor.get("chunks"), f"{key}'s chunks"):
            described_chunk = walk.record(chunk, "ChunkStorageMetadata")
            offsets = walk.shape(described_chunk.get("offsets"), f"{key}'s chunk offsets")
            sizes = walk.shape(described_chunk.get("sizes"), f"{key}'s chunk sizes")
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True))
            ):
                raise walk.fail(f"{key}: a chunk at {list(offsets)} of {list(sizes)} lies "
                                f"outside its tensor of {list(shape)}")  # fmt: skip
            chunks.append(Chunk(offsets, sizes, _stored(walk, stored_by, key, offsets)))
        if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
            raise walk.fail(f"{key}: its chunks do not add up to its {list(shape)} elements")
        if len(chunks) == 1 and (chunks[0].sizes != shape or any(chunks[0].offsets)):
            raise walk.fail(f"{key}: its one chunk is not the whole tensor")
        items[key] = TensorItem(dtype, shape, tuple(chunks))
    _no_shared_bytes(walk, items)
    return DcpMetadata(items, paths)


def _no_shared_bytes(walk: _Walk, items: dict[str, TensorItem | BytesItem]) -> None:
    """Refuse byte ranges that two items (or two chunks) share: each item's bytes are its
    own, so that what is read stays in proportion to the files."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for item in items.values():
        stored = [item.stored] if isinstance(item, BytesItem) else [c.stored for c in item.chunks]
        for where in stored:
            ranges.setdefault(where.file, []).append((where.offset, where.offset + where.length))
    for file, spans in ranges.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise walk.fail(f"two items share bytes of {os.path.basename(file)}")


def _planned_path(walk: _Walk, key: str, value: Any) -> tuple[str | int, ...]:
    parts = walk.sequence(value, f"{key}'s path")
    if not parts or len(parts) > MAX_VALUE_DEPTH or not isinstance(parts[0], str):
        raise walk.fail(f"{key}: a path of the saved dict that is not one")
    if not all(isinstance(p, str) or (type(p) is int and 0 <= p < 1 << 20) for p in parts):
        raise walk.fail(f"{key}: a path of other than names and list positions")
    return tuple(parts)


_Where = tuple[str, tuple[int, ...] | None]


def _storage(walk: _Walk, value: Any, directory: str) -> dict[_Where, Stored]:
    found: dict[_Where, Stored] = {}
    for index, info in walk.mapping(value, "storage_data").items():
        where = walk.record(index, "MetadataIndex")
        fqn, offset = where.get("fqn"), where.get("offset")
        if not isinstance(fqn, str):
            raise walk.fail("a storage index without its key")
        at = None if offset is None else walk.shape(offset, f"{fqn}'s storage offset")
        stored = walk.record(info, "_StorageInfo")
        if stored.get("transform_descriptors") is not None:
            raise CorruptCheckpointError(
                f"{walk.path}: {fqn} is stored through DCP's storage extensions (compressed, "
                "say), which this import does not read"
            )
        name = stored.get("relative_path")
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name == METADATA:
            shown = repr(name[:100]) if isinstance(name, str) else f"a {type(name).__name__}"
            raise walk.fail(f"{fqn}: a data file named {shown}, not a file of the directory")
        if (fqn, at) in found:
            raise walk.fail(f"{fqn}: stored twice at one place")
        found[(fqn, at)] = Stored(
            os.path.join(directory, name),
            walk.integer(stored.get("offset"), f"{fqn}'s offset"),
            walk.integer(stored.get("length"), f"{fqn}'s length"),
        )
    return found


def _stored(
    walk: _Walk, stored_by: dict[_Where, Stored], key: str, offsets: tuple[int, ...] | None
) -> Stored:
    stored = stored_by.get((key, offsets))
    if stored is None:
        at = "" if offsets is None else f" at {list(offsets)}"
        raise walk.fail(f"{key}{at} is described but not stored")
    return stored
