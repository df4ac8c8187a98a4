"""Reading a ``torch.save`` file without running it, within limits.

torch's weights-only unpickler (``torch.load(weights_only=True)``) does the unpickling: a
pickle naming a global outside its allowlist is refused before anything runs. Around it:

* the file must be a regular file (a FIFO or device is refused without blocking on it);
* a torch whose weights-only loader has known bypasses (before 2.10) is refused unless the
  caller vouches for the file (``trusted_source``);
* globals the user trusts (``--trust-global``) must be plain data classes
  (:func:`why_not_plain`), and a refusal suggests trusting a global only when it could be;
* before the load, the pickle is scanned with every global it names replaced by an inert
  stub (nothing it names runs) for the storages it declares: each must lie inside its own
  record of the zip file (a memory-mapped load would otherwise read the zip's other bytes
  as weights), and in the old format all of them inside the file (they are allocated
  before being read);
* after the load, no tensor may have more elements than its storage has from its offset
  (a stride-0 or overlapping view would be written out whole), all tensors together at
  most twice the file's bytes, and the object graph, walked as the tree the importer walks,
  at most a few nodes per byte of the file (a pickle sharing one list within itself grows
  exponentially as a tree).

Violations raise :class:`~ddpckpt.errors.CorruptCheckpointError` or
:class:`~ddpckpt.errors.UnsafeCheckpointError` naming the file.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import importlib
import io
import math
import os
import pickle
import re
import struct
import sys
import zipfile
import zlib
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any

import torch

from ddpckpt._format.boundary import MAX_VALUE_DEPTH
from ddpckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ddpckpt.storage._base import NotRegularFileError
from ddpckpt.storage._posix import load_torch_file, open_regular

# weights_only has known bypasses before these versions (CVE-2025-32434, CVE-2026-24747).
SAFE_TORCH = (2, 10)
NODES_PER_BYTE = 4  # tree nodes the importer may walk per byte of the file
_NODES_FLOOR = 100_000
_BYTES_SLACK = 1 << 20

# Modules whose classes and functions act on the system (processes, files, the network,
# the interpreter): nothing in them is ever trusted, whatever the user names.
_DENIED_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "builtins", "importlib", "sys",
    "shutil", "pickle", "_pickle", "copyreg", "marshal", "ctypes", "_ctypes", "socket", "ssl",
    "select", "selectors", "asyncio", "http", "urllib", "ftplib", "smtplib", "telnetlib",
    "xmlrpc", "webbrowser", "antigravity", "code", "codeop", "runpy", "pdb", "bdb", "types",
    "functools", "operator", "io", "_io", "tempfile", "glob", "fileinput", "zipfile", "tarfile",
    "gzip", "bz2", "lzma", "zipimport", "pkgutil", "logging", "multiprocessing", "concurrent",
    "threading", "_thread", "signal", "platform", "getpass", "pty", "tty", "resource", "mmap",
    "sqlite3", "dbm", "shelve", "inspect", "gc", "atexit", "torch", "numpy",
})  # fmt: skip
# Plain record classes of the standard library, trusted by name (their own __init__ only
# sets attributes).
_PLAIN_CLASSES = frozenset({
    "argparse.Namespace", "types.SimpleNamespace", "pathlib.PurePath", "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath", "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath",
})  # fmt: skip
# What unpickling (or dropping) an instance may call: each must come from a built-in.
_HOOKS = ("__new__", "__init__", "__setstate__", "__reduce__", "__reduce_ex__",
          "__setitem__", "append", "extend", "__hash__", "__eq__", "__del__")  # fmt: skip
_BUILTIN_OWNERS = (object, dict, list, tuple, set, frozenset, OrderedDict, int, float, str)
_WALKED = (dict, OrderedDict, Counter, defaultdict, list, tuple, set, frozenset, deque)


def torch_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def why_not_plain(name: str, obj: Any) -> str | None:
    """Why the global ``name`` (resolved to ``obj``) cannot be trusted, or ``None`` if it
    is a plain data class: a dataclass, named tuple or enum, a plain record class of the
    standard library, or a class that adds no code of its own to how it is built, kept or
    dropped. Never a function, a module, or anything from a module in ``_DENIED_MODULES``."""
    if name in _PLAIN_CLASSES:
        return None
    root = name.split(".")[0]
    if root in _DENIED_MODULES:
        return f"it comes from {root}, whose functions and classes act on the system"
    if not isinstance(obj, type):
        return f"it is a {type(obj).__name__}, not a class"
    if dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum):
        return None
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return None
    for hook in _HOOKS:
        owner = next((c for c in obj.__mro__ if hook in vars(c)), object)
        if owner not in _BUILTIN_OWNERS:
            return f"its {hook} is code of its own ({owner.__module__}.{owner.__qualname__})"
    return None


_TRUSTABLE = (
    "only plain data classes can be trusted: dataclasses, named tuples, enums, "
    "argparse.Namespace, and classes adding no code of their own to how they are built; "
    "never a function, and nothing from os, subprocess, builtins, importlib, sys, shutil, "
    "pickle and other modules that act on the system"
)


def trusted_globals(names: Iterable[str]) -> list[Any]:
    """The objects the user named to trust, each checked by :func:`why_not_plain`."""
    found = []
    for name in names:
        module, _, attr = name.rpartition(".")
        if not module or not attr:
            raise UnsafeCheckpointError(f"trusted global {name!r} must be 'module.Name'")
        if module.split(".")[0] in _DENIED_MODULES and name not in _PLAIN_CLASSES:
            obj = None  # never imported
        else:
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise UnsafeCheckpointError(f"trusted global {name!r}: not found ({exc})") from exc
        why = why_not_plain(name, obj)
        if why is not None:
            raise UnsafeCheckpointError(f"refusing to trust {name}: {why}; {_TRUSTABLE}")
        found.append(obj)
    return found


def read_torch_file(
    path: str, trusted: Iterable[str] = (), trusted_source: bool = False, *, arrays: bool = False,
    stand_ins: Sequence[tuple[Any, str]] = (),
) -> tuple[Any, int]:  # fmt: skip
    """What the ``torch.save`` file ``path`` holds (CPU tensors, memory-mapped where the
    file is in the zip format) and the file's size, within the limits of this module.

    ``arrays`` also allows numpy arrays of plain numbers (the random streams Accelerate and
    the Trainer save hold numpy's): the four numpy globals that rebuild one, as
    ``transformers`` and ``accelerate`` allow them, each array declared empty before its
    bytes are set and exactly its shape's bytes, of a plain number's dtype (the scan refuses
    any other use of them, such as calling ``ndarray`` or an array of Python objects), from a
    file in torch's zip format only. ``stand_ins``: ``(class_or_function, "module.Name")``
    pairs: ddpckpt's own record class (no code of its own: see :func:`why_not_plain`) or
    checking function, built or called where the pickle names a class of another package
    (DeepSpeed's records), which is never imported."""

    def load() -> tuple[Any, int]:
        size = _scan(path)
        if arrays and not zipfile.is_zipfile(path):  # torch >= 1.6 writes its zip format
            raise CorruptCheckpointError(
                f"{path}: not in torch's zip format, which torch.save has written since 1.6"
            )
        return load_torch_file(path), size

    allowed = [*(_numpy_globals() if arrays else []), *stand_ins]
    return _read(path, load, trusted, trusted_source, allowed)


def read_torch_bytes(
    data: bytes, where: str, trusted: Iterable[str] = (), trusted_source: bool = False
) -> Any:
    """What the ``torch.save`` bytes ``data`` (read from ``where``, which errors name) hold,
    within the limits of this module."""

    def load() -> tuple[Any, int]:
        with io.BytesIO(data) as f:
            _scan_stream(f, where, len(data))
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True), len(data)

    return _read(where, load, trusted, trusted_source)[0]


def _numpy_globals() -> list[Any]:
    """The numpy globals a pickled array of numbers needs, under numpy 2's and numpy 1's
    module names."""
    try:
        import numpy as np
    except ImportError as exc:  # torch does not require numpy; the random streams need it
        raise ModuleNotFoundError(
            "the random streams of a Trainer or Accelerate checkpoint hold numpy arrays: "
            "install numpy to import them (pip install 'ddpckpt[numpy]')",
            name="numpy",
        ) from exc

    rebuild = (
        np._core.multiarray._reconstruct
        if hasattr(np, "_core")
        else np.core.multiarray._reconstruct
    )
    return [
        rebuild,
        (rebuild, "numpy.core.multiarray._reconstruct"),
        (rebuild, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def _read(
    path: str,
    load: Callable[[], tuple[Any, int]],
    trusted: Iterable[str],
    trusted_source: bool,
    also: Sequence[Any] = (),
) -> tuple[Any, int]:
    if torch_version() < SAFE_TORCH and not trusted_source:
        raise UnsafeCheckpointError(
            f"torch {torch.__version__}'s weights_only loader has known ways to run code "
            "(CVE-2025-32434 before 2.6, CVE-2026-24747 before 2.10). Upgrade torch to "
            "import files you did not write; pass trusted_source=True (--trusted-source) "
            "only for files you made yourself"
        )
    allowed = [*trusted_globals(trusted), *also]
    try:
        with torch.serialization.safe_globals(allowed):
            obj, size = load()
    except CheckpointError:
        raise
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(f"{path}: {exc.kind}, not a torch.save file") from None
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc) from exc
    except (
        RuntimeError, EOFError, zipfile.BadZipFile, KeyError, IndexError, ValueError, TypeError,
        AttributeError, OSError, AssertionError, OverflowError, MemoryError, struct.error,
        RecursionError,
    ) as exc:  # fmt: skip
        # The weights-only unpickler meets bytes that are no pickle with whatever error the
        # opcode it misreads leads to (a text file gives ``KeyError: 101``; torch checks
        # persistent ids with assert).
        raise CorruptCheckpointError(
            f"{path}: not a torch.save file ({type(exc).__name__}: {exc}); "
            "`import` reads files written by torch.save or Lightning"
        ) from exc
    check_graph(obj, size, path)
    return obj, size


def _refusal(
    path: str, exc: pickle.UnpicklingError
) -> CorruptCheckpointError | UnsafeCheckpointError:
    """The error for a pickle torch refused: a global it names (suggesting to trust it
    only if it could be trusted), or a pickle it cannot read."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if found is None:
        # torch's text goes on to suggest weights_only=False: only the reason is kept
        reason = (
            str(exc).rpartition("WeightsUnpickler error:")[2].strip().split("\n")[0]
            or type(exc).__name__
        )
        return CorruptCheckpointError(
            f"{path}: not a readable torch.save file ({reason}); `import` reads files "
            "written by torch.save or Lightning"
        )
    name = _python3_name(found.group(1))
    module, _, attr = name.rpartition(".")
    loaded = sys.modules.get(module)  # never imported here: its import could run code
    if loaded is not None:
        why = why_not_plain(name, vars(loaded).get(attr))
    elif module.split(".")[0] in _DENIED_MODULES:
        why = why_not_plain(name, None)
    else:
        why = None  # unknown until the user names it: checked then
    advice = (
        f"it cannot be trusted ({why}): this file cannot be imported safely; export the "
        "state from the code that wrote it"
        if why is not None
        else f"if {name} is a plain data class you trust (a dataclass, named tuple or enum "
        f"of your own code), name it with --trust-global {name}; {_TRUSTABLE}. Otherwise "
        "export the state from the code that wrote the file"
    )
    return UnsafeCheckpointError(
        f"{path}: refusing to load it: unpickling would call {name}, and a pickle can run any "
        f"code that way; {advice}"
    )


def _python3_name(written: str) -> str:
    """The global a pickle's ``module.name`` means: Python 2 spellings (``commands.Popen``,
    ``__builtin__.eval``) are read as the unpickler's ``fix_imports`` reads them, and torch
    writes builtins without their module."""
    if "." not in written:
        return f"builtins.{written}"
    module, _, attr = written.rpartition(".")
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        module, attr = _compat_pickle.NAME_MAPPING[(module, attr)]
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attr}"


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


class _Scanner(pickle._Unpickler):  # type: ignore[name-defined]
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


def _scan(path: str) -> int:
    """Check the storages the file at ``path`` declares against its bytes (see the module);
    returns the file's size."""
    with os.fdopen(open_regular(path, follow_links=True), "rb") as f:
        size = f.seek(0, os.SEEK_END)
        _scan_stream(f, path, size)
    return size


def _scan_stream(f: IO[bytes], path: str, size: int) -> None:
    """:func:`_scan` of the open file ``f`` of ``size`` bytes. A pickle of no known layout is
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


def check_graph(obj: Any, file_size: int, path: str) -> None:
    """Walk what was loaded as the importer will (containers as trees, every tensor) within
    the limits of this module; raises :class:`CorruptCheckpointError` naming the file."""
    budget = NODES_PER_BYTE * file_size + _NODES_FLOOR
    stack: list[tuple[Any, int]] = [(obj, 0)]
    views: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    nodes = total = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > budget:
            raise CorruptCheckpointError(
                f"{path}: its objects, walked as a tree, exceed {budget} nodes for a file of "
                f"{file_size} bytes (a pickle sharing parts of itself many times over); refused"
            )
        if isinstance(value, torch.Tensor):
            total += _tensor_bytes(value, views, path)
        elif type(value) in _WALKED:
            if depth >= MAX_VALUE_DEPTH:
                raise CorruptCheckpointError(
                    f"{path}: nested deeper than {MAX_VALUE_DEPTH} levels; refused"
                )
            items = value.items() if isinstance(value, Mapping) else value
            for item in items:
                stack.append((item, depth + 1))
    if total > 2 * file_size + _BYTES_SLACK:
        raise CorruptCheckpointError(
            f"{path}: its tensors would take {total} bytes, from a file of {file_size}; refused"
        )


def _tensor_bytes(tensor: torch.Tensor, views: set[Any], path: str) -> int:
    """The bytes ``tensor`` would be written as (0 if the same view was seen already);
    refuses a view with more elements than its storage holds for it."""
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return 0  # refused by the writer, with its key
    view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()))  # fmt: skip
    if view in views:
        return 0
    views.add(view)
    numel = tensor.numel()
    if numel == 0:
        return 0
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    if numel > extent:
        raise CorruptCheckpointError(
            f"{path}: a tensor of shape {list(tensor.shape)} has strides {list(tensor.stride())}: "
            f"it repeats {extent} stored elements as {numel} (a stride-0 or overlapping view); "
            "refused"
        )
    return numel * tensor.element_size()
