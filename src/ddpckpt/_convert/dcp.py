"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running its pickle.

A DCP directory (``dcp.save``, ``dcp.async_save``) holds ``.metadata``, a
pickle of DCP's ``Metadata``, and ``*.distcp`` files. ``torch.distributed.checkpoint.load``
unpickles ``.metadata`` with the standard unpickler, so a directory from someone else can
run any code; DCP documents that it assumes a trusted environment. Here:

* ``.metadata`` is read by a restricted unpickler that knows DCP's own metadata classes, the
  ``torch`` dtypes, ``torch.Size`` and layouts and the ``pathlib`` paths DCP writes, each as
  an inert record (none of DCP's code runs, nor is DCP imported). Any other global is
  refused before it is called (:class:`~ddpckpt.errors.UnsafeCheckpointError`). The file is
  bounded (:data:`MAX_METADATA_BYTES`), and walking what it holds is bounded by its size
  (a pickle sharing its parts many times over is refused);
* every item is a ``torch.save`` blob at an offset of a ``.distcp`` file: a regular file
  of the directory (never a link), the range inside it, read by
  :func:`ddpckpt._convert.torchfile.read_torch_bytes` (torch's weights-only unpickler, within
  its limits);
* a tensor's chunks (a sharded save writes one per shard) must tile the tensor exactly, each
  of its declared shape and dtype; a tensor is never allocated larger than the bytes its
  chunks hold.

What it returns is the state dict that was saved, nested again as DCP's planner recorded it
(``{"model": {...}, "optim": {"state": ..., "param_groups": [...]}}``), with whole tensors.
Violations raise :class:`~ddpckpt.errors.CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ddpckpt._convert.torchfile import buffer_in, read_torch_bytes
from ddpckpt._format.boundary import MAX_VALUE_DEPTH
from ddpckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from ddpckpt.storage._base import NotRegularFileError
from ddpckpt.storage._posix import open_regular

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30
NODES_PER_BYTE = 4  # records walked per byte of .metadata
_NODES_FLOOR = 100_000
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_MAX_DIM = 1 << 63
# The dtypes a checkpoint holds, by the name torch pickles them with.
DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                 "int64", "int32", "int16", "int8", "uint8", "bool", "float8_e4m3fn",
                 "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}  # fmt: skip
_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr"})
_PATHS = frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                    "PureWindowsPath"})  # fmt: skip
_DCP_RECORDS = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
}  # fmt: skip


def is_dcp_directory(path: str) -> bool:
    """Whether ``path`` is a directory holding DCP's ``.metadata``."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, METADATA))


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


# ---------------------------------------------------------------- the restricted unpickler


class _Record:
    """What each of DCP's metadata classes becomes: its arguments and state, inert."""

    kind = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    args: tuple[Any, ...]
    state: Any


_RECORD_TYPES: dict[str, type[_Record]] = {
    name: type(name, (_Record,), {"kind": name})
    for names in _DCP_RECORDS.values()
    for name in names
}


class _Call:
    """A global the metadata may call (``torch.Size``, a layout, a path): a fresh instance
    per global named, so that nothing a pickle does to it outlives the read."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("state set on a function")


def _size(values: Any = ()) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not all(
        type(v) is int and 0 <= v < _MAX_DIM for v in values
    ):
        raise pickle.UnpicklingError("a torch.Size of other than non-negative integers")
    return tuple(values)


def _layout(name: Any) -> str:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"an unknown layout (a {type(name).__name__})")
    return name


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path of other than strings")
    return "/".join(parts)


def _memory_format(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 16:
        raise pickle.UnpicklingError("a memory format of other than a small integer")
    return value


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """DCP's metadata, each global it names an inert stand-in; any other global refused.

    The pure-Python unpickler keeps its memo in a dict (the C one grows an array to the
    largest index a pickle names)."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file, encoding="utf-8")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_RECORDS.get(module, ()):
            return _RECORD_TYPES[name]
        if module == "torch.distributed.checkpoint.metadata" and name == "_MEM_FORMAT_ENCODING":
            return _Call(_memory_format)
        if module == "torch" and name == "Size":
            return _Call(_size)
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        if module == "torch.serialization" and name == "_get_layout":
            return _Call(_layout)
        if module == "pathlib" and name in _PATHS:
            return _Call(_path)
        if module in ("collections", "builtins") and name in ("OrderedDict", "dict"):
            return _Call(dict)
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to read it: unpickling would call {module}.{name}, which "
            "is none of DCP's metadata records nor a dtype a checkpoint holds (a pickle can "
            "run any code that way)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP's metadata holds no persistent ids")

    # Keys are hashed as they are stored: a tuple nesting itself through the memo takes
    # exponential time to hash. DCP's keys are names, or records (hashed by identity).
    def _key(self, key: Any) -> Any:
        if type(key) in (str, int) or key is None or isinstance(key, _Record):
            return key
        raise pickle.UnpicklingError(f"a dict key of type {type(key).__name__}")

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self.stack[-1][self._key(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        for i in range(0, len(items) - 1, 2):
            target[self._key(items[i])] = items[i + 1]

    def load_no_sets(self) -> None:
        raise pickle.UnpicklingError("DCP's metadata holds no sets")

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.EMPTY_SET[0]] = load_no_sets
    dispatch[pickle.ADDITEMS[0]] = load_no_sets
    dispatch[pickle.FROZENSET[0]] = load_no_sets


_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                  IndexError, KeyError, OverflowError, MemoryError, RecursionError,
                  struct.error, UnicodeDecodeError)  # fmt: skip


def _unpickle(path: str) -> tuple[Any, int]:
    try:
        fd = open_regular(path, follow_links=False)
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(f"{path}: {exc.kind}, not DCP's metadata") from None
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing: not a DCP checkpoint") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, over the {MAX_METADATA_BYTES} a DCP metadata file may "
                "have here; refused"
            )
        f.seek(0)
        try:
            return _MetadataUnpickler(f, path).load(), size
        except UnsafeCheckpointError:
            raise
        except _PICKLE_ERRORS as exc:
            raise CorruptCheckpointError(
                f"{path}: not DCP's metadata ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None


# ---------------------------------------------------------------- typed reading


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


# ---------------------------------------------------------------- the items


class _Files:
    """The directory's data files, opened once each, never through a link."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def read(self, stored: Stored) -> bytes:
        try:
            fd = open_regular(stored.file, follow_links=False)
        except NotRegularFileError as exc:
            raise CorruptCheckpointError(
                f"{stored.file}: {exc.kind}, not a DCP data file"
            ) from None
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{stored.file}: missing (named by .metadata)") from None
        except OSError as exc:
            raise CorruptCheckpointError(
                f"{stored.file}: cannot be read ({exc.strerror})"
            ) from None
        with os.fdopen(fd, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if stored.offset + stored.length > size:
                raise CorruptCheckpointError(
                    f"{stored.file}: .metadata places an item at bytes {stored.offset} to "
                    f"{stored.offset + stored.length}, past the file's end ({size})"
                )
            f.seek(stored.offset)
            return f.read(stored.length)


def _tensor(
    key: str, item: TensorItem, files: _Files, load: Callable[[bytes, str], Any]
) -> torch.Tensor:
    claimed = math.prod(item.size) * item.dtype.itemsize
    held = sum(c.stored.length for c in item.chunks)
    if claimed > 2 * held + (1 << 20):
        raise CorruptCheckpointError(
            f"{key}: .metadata claims {claimed} bytes for it, stored in {held}; refused"
        )
    if not item.chunks:  # a tensor without elements
        return _allocate(key, item, torch.empty)
    whole = _allocate(key, item, torch.empty) if len(item.chunks) > 1 else None
    covered = _allocate(key, item, torch.zeros, torch.bool) if whole is not None else None
    for chunk in item.chunks:
        where = f"{chunk.stored.file} ({key}, bytes {chunk.stored.offset}+{chunk.stored.length})"
        value = load(files.read(chunk.stored), where)
        if (
            not isinstance(value, torch.Tensor)
            or tuple(value.shape) != chunk.sizes
            or value.dtype != item.dtype
            or value.layout != torch.strided
            or value.device.type != "cpu"
            or value.is_quantized
        ):
            raise CorruptCheckpointError(
                f"{where}: holds {_describe(value)}, where .metadata says a {item.dtype} tensor "
                f"of {list(chunk.sizes)}"
            )
        if whole is None or covered is None:  # the one chunk is the tensor
            return value
        region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        if covered[region].any():
            raise CorruptCheckpointError(f"{where}: overlaps another chunk of {key}")
        covered[region] = True
        whole[region] = value
    return whole


def _allocate(
    key: str, item: TensorItem, make: Callable[..., torch.Tensor], dtype: torch.dtype | None = None
) -> torch.Tensor:
    try:
        return make(item.size, dtype=dtype or item.dtype)
    except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:
        raise CorruptCheckpointError(
            f"{key}: a tensor of its declared size cannot be made ({type(exc).__name__})"
        ) from None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {list(value.shape)}"
    return f"a {type(value).__name__}"


def read_dcp(
    directory: str | os.PathLike[str],
    trusted: Iterable[str] = (),
    trusted_source: bool = False,
) -> dict[str, Any]:
    """The state dict saved in the DCP directory ``directory``, nested as it was saved, with
    whole tensors (a sharded save's chunks put together); local."""
    directory = os.fspath(directory)
    metadata = read_metadata(directory)
    files = _Files()
    trusted = list(trusted)

    def load(data: bytes, where: str) -> Any:
        return read_torch_bytes(data, where, trusted, trusted_source)

    nested = _Nested()
    for key, item in metadata.items.items():
        if isinstance(item, BytesItem):
            where = f"{item.stored.file} ({key}, bytes {item.stored.offset}+{item.stored.length})"
            data = files.read(item.stored)
            inner = buffer_in(data, where)  # an io.BytesIO (torchtitan's train state)
            if inner is None:
                value = load(data, where)
            elif zipfile.is_zipfile(io.BytesIO(inner)):
                value = load(inner, f"{where}, the torch.save file in its buffer")
            else:
                value = inner
        else:
            value = _tensor(key, item, files, load)
        nested.place(metadata.paths[key], value, key)
    return nested.rebuilt()


class _Nested:
    """The saved dict, put together again from each item's path."""

    def __init__(self) -> None:
        self.root: dict[Any, Any] = {}
        self.made: set[int] = {id(self.root)}  # the containers built here, not loaded values

    def place(self, path: tuple[str | int, ...], value: Any, key: str) -> None:
        node = self.root
        for part in path[:-1]:
            if part not in node:
                node[part] = {}
                self.made.add(id(node[part]))
            node = node[part]
            if id(node) not in self.made:
                raise CorruptCheckpointError(f"{key}: its path in the saved dict crosses a value")
        if path[-1] in node:
            raise CorruptCheckpointError(f"{key}: two items at one place of the saved dict")
        node[path[-1]] = value

    def rebuilt(self) -> dict[str, Any]:
        """The containers built here that are keyed 0..n-1 (DCP flattens a list into its
        positions) as lists again; loaded values as they were."""

        def rebuild(node: Any) -> Any:
            if not isinstance(node, dict) or id(node) not in self.made:
                return node
            done = {k: rebuild(v) for k, v in node.items()}
            keys = list(done)
            if (
                keys
                and all(type(k) is int for k in keys)
                and sorted(keys) == list(range(len(keys)))
            ):
                return [done[i] for i in range(len(keys))]
            return done

        rebuilt: dict[str, Any] = rebuild(self.root)
        return rebuilt
