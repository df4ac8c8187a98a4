"""Reading a ``torch.save`` file without running it, within limits.

torch's weights-only unpickler (``torch.load(weights_only=True)``) does the unpickling: a
pickle naming a global outside its allowlist is refused before anything runs. Around it:

* the file must be a regular file (a FIFO or device is refused without blocking on it);
* a torch whose weights-only loader has known bypasses (before 2.10) is refused unless the
  caller vouches for the file (``trusted_source``);
* globals the user trusts (``--trust-global``) must be plain data classes
  (:func:`~ddpckpt._convert.pickle_trust.why_not_plain`), and a refusal suggests trusting a
  global only when it could be;
* before the load, the pickle is scanned (:mod:`ddpckpt._convert.pickle_scan`) with every
  global it names replaced by an inert stub (nothing it names runs) for the storages it
  declares: each must lie inside its own record of the zip file (a memory-mapped load
  would otherwise read the zip's other bytes as weights), and in the old format all of
  them inside the file (they are allocated before being read);
* after the load, no tensor may have more elements than its storage has from its offset
  (a stride-0 or overlapping view would be written out whole), all tensors together at
  most twice the file's bytes, and the object graph, walked as the tree the importer walks,
  at most a few nodes per byte of the file (a pickle sharing one list within itself grows
  exponentially as a tree).

Violations raise :class:`~ddpckpt.errors.CorruptCheckpointError` or
:class:`~ddpckpt.errors.UnsafeCheckpointError` naming the file.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ddpckpt._convert.pickle_scan import scan, scan_stream
from ddpckpt._convert.pickle_trust import refusal, trusted_globals
from ddpckpt._format.boundary import MAX_VALUE_DEPTH
from ddpckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._posix import load_torch_file

# weights_only has known bypasses before these versions (CVE-2025-32434, CVE-2026-24747).
SAFE_TORCH = (2, 10)
NODES_PER_BYTE = 4  # tree nodes the importer may walk per byte of the file
_NODES_FLOOR = 100_000
_BYTES_SLACK = 1 << 20
_WALKED = (dict, OrderedDict, Counter, defaultdict, list, tuple, set, frozenset, deque)


def torch_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


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
    pairs: ddpckpt's own record class (no code of its own: see
    :func:`~ddpckpt._convert.pickle_trust.why_not_plain`) or
    checking function, built or called where the pickle names a class of another package
    (DeepSpeed's records), which is never imported."""

    def load() -> tuple[Any, int]:
        size = scan(path)
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
            scan_stream(f, where, len(data))
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
        # numpy 1's name: numpy 2's stubs (the ones installed) lack np.core.multiarray
        else np.core.multiarray._reconstruct  # type: ignore[attr-defined]
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
        raise refusal(path, exc) from exc
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
