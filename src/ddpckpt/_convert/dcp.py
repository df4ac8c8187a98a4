"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running its pickle.

A DCP directory (``dcp.save``, ``dcp.async_save``) holds ``.metadata``, a
pickle of DCP's ``Metadata``, and ``*.distcp`` files. ``torch.distributed.checkpoint.load``
unpickles ``.metadata`` with the standard unpickler, so a directory from someone else can
run any code; DCP documents that it assumes a trusted environment. Here:

* ``.metadata`` is read by a restricted unpickler (:mod:`ddpckpt._convert.dcp_unpickler`)
  that knows DCP's own metadata classes, the ``torch`` dtypes, ``torch.Size`` and layouts
  and the ``pathlib`` paths DCP writes, each as an inert record (none of DCP's code runs,
  nor is DCP imported). Any other global is refused before it is called
  (:class:`~ddpckpt.errors.UnsafeCheckpointError`). The file is bounded
  (:data:`~ddpckpt._convert.dcp_unpickler.MAX_METADATA_BYTES`), and walking what it holds
  (:mod:`ddpckpt._convert.dcp_metadata`) is bounded by its size (a pickle sharing its
  parts many times over is refused);
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
import math
import os
import zipfile
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from ddpckpt._convert.dcp_metadata import METADATA, BytesItem, Stored, TensorItem, read_metadata
from ddpckpt._convert.pickle_scan import buffer_in
from ddpckpt._convert.torchfile import read_torch_bytes
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._posix import open_regular


def is_dcp_directory(path: str) -> bool:
    """Whether ``path`` is a directory holding DCP's ``.metadata``."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, METADATA))


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
    return cast(torch.Tensor, whole)  # several chunks: allocated above (one chunk returned)


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
