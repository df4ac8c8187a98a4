"""The scan of a ``torch.save`` pickle before it is loaded: read with every global it names
replaced by an inert stub (nothing it names is imported or called), for the storages it
declares. Each must lie inside its own record of the zip file (a memory-mapped load would
otherwise read the zip's other bytes as weights), and in the old format all of them inside
the file (they are allocated before being read). The few globals it models (numpy arrays of
numbers, ``io.BytesIO``) must be pickled as their own code pickles them; the bytes of a DCP
buffer item are read by the scan alone (:func:`buffer_in`)."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from typing import IO, Any

import torch

from ddpckpt.errors import CheckpointError, CorruptCheckpointError
from ddpckpt.storage._posix import open_regular


class _Stub:
    """What every global of a scanned pickle becomes: accepts anything, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


_ARRAY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")
# the numpy dtypes allowed, as numpy pickles them (``dtype("u4", False, True)``), by size:
# 32-bit unsigned integers, as numpy's random streams hold (torch's allowlist rebuilds no other)
_NUMBER_CODES = {"u4": 4}


class Refused(pickle.UnpicklingError):
    """What the scan refuses of the few globals it models: a numpy value other than an array
    of numbers pickled as numpy pickles one (allowed for random streams only), an
    ``io.BytesIO`` other than one holding bytes."""


class _ArrayType(_Stub):
    """``numpy.ndarray`` in a scanned pickle: only ever the first argument of
    ``_reconstruct``; calling it (which allocates the shape it is given) is refused."""

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        raise Refused("the pickle calls numpy.ndarray itself, as numpy never pickles")


_ARRAY_TYPE = _ArrayType()


class _DType(_Stub):
    """A numpy dtype of plain numbers in a scanned pickle; its state must add nothing (no
    fields, no subarray, no flags such as holding objects)."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 8 and state[2:5] == (None, None, None)
                and state[5:] == (-1, -1, 0)):  # fmt: skip
            raise Refused(f"a numpy dtype with state {state!r:.80}, not a plain number's")


def _dtype(*args: Any) -> _DType:
    """``numpy.dtype`` as a scanned pickle calls it: a plain number's code only."""
    if len(args) != 3 or args[1:] != (False, True) or args[0] not in _NUMBER_CODES:
        raise Refused(f"a numpy dtype made as {args!r:.80}, not a plain number's")
    return _DType(_NUMBER_CODES[args[0]])


class _Array(_Stub):
    """An array numpy pickled: empty, then its state sets shape, dtype and bytes, which must
    be exactly the bytes of that shape (never a list of objects)."""

    def __setstate__(self, state: Any) -> None:
        ok = (
            isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], _DType)
            and isinstance(state[4], bytes) and isinstance(state[1], tuple)
            and all(type(n) is int and n >= 0 for n in state[1])
        )  # fmt: skip
        if not ok or len(state[4]) != math.prod(state[1]) * state[2].itemsize:
            raise Refused("a numpy array whose state is not its shape's bytes")


def _empty_array(*args: Any) -> _Array:
    """numpy's ``_reconstruct`` as a scanned pickle calls it: numpy pickles every array as an
    empty one (``_reconstruct(ndarray, (0,), b'b')``) whose bytes are set afterwards, and
    allocates the shape it is given, so any other call is refused."""
    if len(args) != 3 or args[0] is not _ARRAY_TYPE or args[1] != (0,) or args[2] != b"b":
        raise Refused(f"an array rebuilt as {args[1:]!r:.80}, not as numpy pickles one")
    return _Array()


def _latin1(text: Any, encoding: Any = "utf-8") -> Any:
    """``_codecs.encode`` as protocol 2 pickles bytes with it (a latin-1 text)."""
    if isinstance(text, str) and encoding == "latin1":
        return text.encode("latin1")
    return _Stub()


class _Buffer(_Stub):
    """``io.BytesIO`` in a scanned pickle (DCP pickles one as it is): its bytes, once built
    with exactly the state a BytesIO pickles (bytes, a position, no attributes)."""

    value: bytes | None = None

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], bytes)
                and type(state[1]) is int and state[2] in (None, {})):  # fmt: skip
            raise Refused(f"an io.BytesIO with state {state!r:.80}, not one of bytes")
        self.value = state[0]


_SCANNED: dict[tuple[str, str], Any] = {
    ("_io", "BytesIO"): _Buffer,
    **{(m, "_reconstruct"): _empty_array for m in _ARRAY_MODULES},
    ("numpy", "ndarray"): _ARRAY_TYPE,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1,
}


class _StorageType(_Stub):
    """A storage class a scanned pickle names (``torch.FloatStorage``): its element size."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize


def _storage_itemsize(module: str, name: str) -> int | None:
    if module != "torch" or not name.endswith("Storage"):
        return None
    return _STORAGE_ITEMSIZE.get(name)


_STORAGE_ITEMSIZE = {"UntypedStorage": 1} | {
    name: dtype.itemsize for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}


class _Scanner(pickle._Unpickler):
    """Reads a pickle with every global an inert :class:`_Stub`, collecting the storages it
    declares (their key and byte count); nothing the pickle names is imported or called.

    The pure-Python unpickler keeps its memo in a dict: the C one grows an array to the
    largest index a pickle names (a six-byte opcode asks for gigabytes)."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, encoding="utf-8")
        self.storages: dict[str, int] = {}
        self.root: Any = None  # what the pickle built, once loaded

    def find_class(self, module: str, name: str) -> Any:
        scanned = _SCANNED.get((str(module), str(name)))
        if scanned is not None:
            return scanned
        itemsize = _storage_itemsize(str(module), str(name))
        return _StorageType(itemsize) if itemsize is not None else _Stub

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage"):
            kind, key, numel = pid[1], pid[2], pid[4]
            if not isinstance(kind, _StorageType) or type(numel) is not int or numel < 0:
                raise pickle.UnpicklingError(f"malformed storage record {pid!r:.200}")
            key = key.decode() if isinstance(key, bytes) else str(key)
            self.storages[key] = max(self.storages.get(key, 0), numel * kind.itemsize)
        return _Stub()


def scan(path: str) -> int:
    """Check the storages the file at ``path`` declares against its bytes (see the module);
    returns the file's size."""
    with os.fdopen(open_regular(path, follow_links=True), "rb") as f:
        size = f.seek(0, os.SEEK_END)
        scan_stream(f, path, size)
    return size


def scan_stream(f: IO[bytes], path: str, size: int) -> None:
    """:func:`scan` of the open file ``f`` of ``size`` bytes. A pickle of no known layout is
    left for torch to report."""
    f.seek(0)
    if not zipfile.is_zipfile(f):
        _scan_old_format(f, path, size)
        return
    with zipfile.ZipFile(f) as archive:
        pickle_name, records = _pickle_record(archive, path)
        if pickle_name is None:
            return  # torch reports what it misses
        prefix = pickle_name[: -len("data.pkl")]
        with archive.open(pickle_name) as pickled:
            storages = _storages(pickled, path)
    for key, nbytes in storages.items():
        record = records.get(f"{prefix}data/{key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{path}: the pickle names storage {key!r}, which the file lacks"
            )
        stored = record.compress_size if record.compress_type == zipfile.ZIP_STORED else 0
        if nbytes > stored:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} has {stored} bytes stored in the file, but its "
                f"tensors claim {nbytes}: the file is damaged (reading it would read the file's "
                "other bytes as weights)"
            )


def _pickle_record(archive: zipfile.ZipFile, path: str) -> tuple[str | None, dict[str, Any]]:
    """The name of the pickle torch reads from ``archive`` (``data.pkl`` under the directory
    of the archive's first record, as torch finds it) and the records by name. Two records
    of one name, or a ``data.pkl`` elsewhere, are refused: the scan and torch would read
    different pickles."""
    infos = archive.infolist()
    records = {info.filename: info for info in infos}
    if len(records) != len(infos):
        raise CorruptCheckpointError(f"{path}: two records of its zip have one name; refused")
    if not infos:
        return None, records
    name = infos[0].filename.split("/")[0] + "/data.pkl"
    pickles = [n for n in records if n == "data.pkl" or n.endswith("/data.pkl")]
    if pickles and pickles != [name]:
        raise CorruptCheckpointError(
            f"{path}: holds a pickle where torch does not read one ({pickles[0][:100]!r}); refused"
        )
    return (name if pickles else None), records


def buffer_in(data: bytes, where: str) -> bytes | None:
    """The bytes of the ``io.BytesIO`` that the ``torch.save`` bytes ``data`` hold, as DCP
    writes a buffer item; ``None`` if they hold anything else, or are no readable zip (the
    load that follows says why). Read by the scan alone (no torch.load): the bytes come from
    the pickle itself."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            name, _ = _pickle_record(archive, where)
            if name is None:
                return None
            with archive.open(name) as pickled:
                root = _scanned(pickled, where).root
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, NotImplementedError, OSError):
        return None
    return root.value if isinstance(root, _Buffer) else None


def _scan_old_format(f: IO[bytes], path: str, size: int) -> None:
    """The format before torch 1.6: magic number, protocol, system info, then the object
    pickle; the storages it declares are allocated before they are read."""
    f.seek(0)
    storages: dict[str, int] = {}
    try:
        for _ in range(4):
            scanner = _Scanner(f)
            scanner.load()
            storages.update(scanner.storages)
    except Refused as exc:
        raise CorruptCheckpointError(f"{path}: refused: {exc}") from None
    except _PICKLE_ERRORS:
        return  # no pickle of that format: torch reports what it is not
    claimed = sum(storages.values())
    if claimed > size:
        raise CorruptCheckpointError(
            f"{path}: its storages claim {claimed} bytes in a file of {size}: the file is damaged"
        )


# What a malformed pickle makes the standard unpickler raise (it has no one error type).
_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                  IndexError, KeyError, OverflowError, MemoryError, RecursionError,
                  struct.error)  # fmt: skip


def _storages(f: IO[bytes], path: str) -> dict[str, int]:
    return _scanned(f, path).storages


def _scanned(f: IO[bytes], path: str) -> _Scanner:
    """The scan of the pickle ``f`` (its ``root`` object, the ``storages`` it declares);
    :class:`CorruptCheckpointError` naming ``path`` for a refused or unreadable one."""
    scanner = _Scanner(f)
    try:
        scanner.root = scanner.load()
    except Refused as exc:
        raise CorruptCheckpointError(f"{path}: refused: {exc}") from None
    except _PICKLE_ERRORS as exc:
        raise CorruptCheckpointError(
            f"{path}: not a readable torch.save file (its pickle: {type(exc).__name__}: "
            f"{str(exc)[:200]})"
        ) from None
    return scanner
