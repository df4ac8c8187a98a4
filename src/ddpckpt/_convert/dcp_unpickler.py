"""The restricted unpickler for a DCP directory's ``.metadata``: DCP's metadata classes, the
``torch`` dtypes, ``torch.Size``, layouts and the ``pathlib`` paths DCP writes, each an
inert stand-in (none of DCP's code runs, nor is DCP imported); any other global is refused
before it is called (:class:`~ddpckpt.errors.UnsafeCheckpointError`). The file is bounded
(:data:`MAX_METADATA_BYTES`). What it gives is untyped: :mod:`ddpckpt._convert.dcp_metadata`
reads the records it holds.
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ddpckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._posix import open_regular

MAX_METADATA_BYTES = 1 << 30
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


class _MetadataUnpickler(pickle._Unpickler):
    """DCP's metadata, each global it names an inert stand-in; any other global refused.

    The pure-Python unpickler keeps its memo in a dict (the C one grows an array to the
    largest index a pickle names)."""

    # The pure-Python unpickler's own, which typeshed leaves out (``stack`` is set by load()).
    stack: list[Any]
    pop_mark: Callable[[], list[Any]]

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

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
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
