"""Tensor data files: the safetensors format's records, dtypes and header.

The files are plain safetensors (an 8-byte little-endian header length, a JSON header with
each tensor's dtype, shape and byte range, then the raw bytes), so any safetensors reader
opens them. Tensors are laid out widest element first (:func:`layout`), so every tensor
starts at an offset aligned to its element size (the header is padded to 8 bytes) and
memory-mapped views are aligned. The manifest records each file (:class:`FileEntry`) and
each tensor (:class:`TensorEntry`) with its xxh3-64 digest.

Writing a file is :mod:`ddpckpt._format.tensorwrite`, reading one
:mod:`ddpckpt._format.tensorread`; both pass GPU tensors through the pinned buffers of
:mod:`ddpckpt._format.pinned_ring`.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import Any

import torch

from ddpckpt._format.boundary import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_INT,
    Fields,
    check_int,
    load_json,
)
from ddpckpt.errors import CorruptCheckpointError, UnsupportedValueError

CHUNK = 8 << 20  # bytes hashed and written or read at a time

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _attr, _name in (
    ("uint64", "U64"),
    ("uint32", "U32"),
    ("uint16", "U16"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_ITEMSIZES = {name: dtype.itemsize for name, dtype in _DTYPES_BY_NAME.items()}


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; ``key`` names the tensor in the error if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in _DTYPE_NAMES))
        raise UnsupportedValueError(
            f"{key}: dtype {dtype} cannot be stored in a safetensors file "
            f"(supported: {supported}); convert the tensor before saving"
        ) from None


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: unknown tensor dtype {str(name)[:40]!r}") from None


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: ``file``, its key there, and its absolute byte range.

    ``chunks``: the digest of each :data:`CHUNK` bytes of it, when the writer was asked
    for them (a shard of a sharded tensor, which loading ranks may read in part).
    """

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    digest: str
    chunks: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileEntry:
    """A whole data file: its size, xxh3-64 digest, and the rank that wrote it."""

    name: str
    size: int
    digest: str
    writer: int


MAX_EXTENT = 1 << 62  # the bytes a tensor may span, its empty dimensions counted as 1


def spanned_bytes(shape: Sequence[int], itemsize: int) -> int | None:
    """The bytes a tensor of ``shape`` spans with its empty dimensions counted as 1 (its
    largest stride, in bytes), or ``None`` from :data:`MAX_EXTENT` on: checked one factor
    at a time, so no product of hostile numbers is ever formed."""
    total = itemsize
    for size in shape:
        total *= max(size, 1)
        if total >= MAX_EXTENT:
            return None
    return total


def checked_layout(
    fields: Fields, file_size: int, base: int = 0, offsets_key: str = "offsets"
) -> tuple[str, tuple[int, ...], int, int]:
    """A tensor record's dtype, shape and absolute byte range, read from ``fields`` and
    checked against a file of ``file_size`` bytes whose data starts at ``base``: a known
    dtype, at most 64 dimensions, a range inside the file holding exactly the bytes the
    shape needs, aligned to the element size (as ddpckpt writes them). Nothing is
    allocated before this holds."""
    doc = fields.doc
    dtype, shape, span = doc.get("dtype"), doc.get("shape"), doc.get(offsets_key)
    itemsize = _ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
    if (  # the record as ddpckpt writes it, checked without building any error
        isinstance(dtype, str)
        and itemsize is not None
        and type(shape) is list
        and len(shape) <= MAX_DIMS
        and all(type(d) is int and 0 <= d <= MAX_INT for d in shape)
        and spanned_bytes(shape, itemsize) is not None
        and type(span) is list
        and len(span) == 2
        and type(span[0]) is int
        and type(span[1]) is int
        and 0 <= span[0] <= span[1] <= file_size - base
        and span[1] - span[0] == math.prod(shape) * itemsize
        and (base + span[0]) % itemsize == 0
    ):
        return dtype, tuple(shape), base + span[0], base + span[1]
    return _refused_layout(fields, file_size, base, offsets_key)


def _refused_layout(fields: Fields, file_size: int, base: int, offsets_key: str) -> Any:
    """Raise the error naming what :func:`checked_layout` found wrong."""
    dtype = fields.text("dtype", max_length=16)
    if dtype not in _DTYPES_BY_NAME:
        raise fields.error(f"names an unknown dtype {dtype!r}", "dtype")
    shape_doc = fields.sequence("shape")
    if len(shape_doc) > MAX_DIMS:
        raise fields.error(f"has {len(shape_doc)} dimensions (at most {MAX_DIMS})", "shape")
    shape = tuple(check_int(d, 0, MAX_INT, lambda p: fields.error(p, "shape")) for d in shape_doc)
    itemsize = _ITEMSIZES[dtype]
    if spanned_bytes(shape, itemsize) is None:
        raise fields.error(f"of {dtype} spans 2**62 bytes or more (a dimension too large)", "shape")
    span = fields.sequence(offsets_key)
    if len(span) != 2:
        raise fields.error("is not a pair [begin, end]", offsets_key)
    limit = file_size - base
    begin, end = (check_int(x, 0, limit, lambda p: fields.error(p, offsets_key)) for x in span)
    if end < begin or end - begin != math.prod(shape) * itemsize:
        raise fields.error(
            f"is [{begin}, {end}]: {end - begin} bytes, where {dtype} of shape {list(shape)} "
            f"takes {math.prod(shape) * itemsize}",
            offsets_key,
        )
    raise fields.error(f"starts at byte {base + begin}, not aligned to {itemsize}", offsets_key)


@dataclass(frozen=True)
class FileHeader:
    """A safetensors file's header, checked: where the data starts, each tensor's record
    (absolute offsets, no digest) in file order, and the metadata."""

    start: int
    entries: list[TensorEntry] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)


def read_header(
    read: Callable[[int, int], bytes], file_size: int, where: str, name: str
) -> FileHeader:
    """Parse the header of the safetensors file ``name`` (at ``where``, ``file_size`` bytes;
    ``read(offset, length)`` gives its bytes) within the limits of
    :mod:`ddpckpt._format.boundary`: the length is checked against the file and the cap
    before the header is read, every record as :func:`checked_layout` checks it, and no two
    records overlap. Raises :class:`CorruptCheckpointError` naming the file and field."""
    prefix = read(0, 8)
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            f"{where}: damaged safetensors header: the file is {file_size} bytes"
        )
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, file_size - 8):
        raise CorruptCheckpointError(
            f"{where}: damaged safetensors header: it claims {length} bytes in a file of "
            f"{file_size} (at most {MAX_HEADER_BYTES})"
        )
    doc = load_json(read(8, length), where, "safetensors header", limit=MAX_HEADER_BYTES)
    header = Fields(doc, where, "safetensors header")
    metadata = header.mapping("__metadata__", {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise header.error("holds a value that is not a string", "__metadata__")
    start, entries = 8 + length, []
    for key, record in doc.items():
        if key == "__metadata__":
            continue
        fields = Fields(record, where, partial(_entry_what, key))
        dtype, shape, begin, end = checked_layout(fields, file_size, start, "data_offsets")
        entries.append(TensorEntry(name, key, dtype, shape, begin, end, ""))
    entries.sort(key=lambda e: (e.begin, e.end))
    for before, after in pairwise(entries):
        if after.begin < before.end:
            raise CorruptCheckpointError(
                f"{where}: damaged safetensors header: {before.key!r} and {after.key!r} overlap"
            )
    return FileHeader(start, entries, metadata)


def _entry_what(key: str) -> str:
    """How an error names the safetensors header entry ``key``."""
    return f"safetensors header entry {key[:200]!r}"


def check_storable(key: str, tensor: torch.Tensor) -> None:
    """Raise :class:`UnsupportedValueError` naming ``key`` if ``tensor`` cannot be written."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise UnsupportedValueError(
            f"{key}: tensor subclass {type(tensor).__qualname__} cannot be stored; "
            "convert it to a plain tensor (e.g. DTensor.full_tensor()) before saving"
        )
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(
            f"{key}: {tensor.layout} tensors cannot be stored; call .to_dense() before saving"
        )
    if tensor.is_quantized or tensor.device.type == "meta":
        what = "quantized" if tensor.is_quantized else "meta"
        raise UnsupportedValueError(f"{key}: {what} tensors hold no storable data")
    dtype_name(tensor.dtype, key)


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (valid while ``tensor`` lives)."""
    nbytes = tensor_nbytes(tensor)
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def encode_header(items: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, tensor in items:
        nbytes = tensor_nbytes(tensor)
        header[key] = {
            "dtype": dtype_name(tensor.dtype, key),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    if len(raw) > MAX_HEADER_BYTES:  # what could not be read back is not written
        raise UnsupportedValueError(
            f"a safetensors header of {len(raw)} bytes (over {MAX_HEADER_BYTES}) would be "
            "needed: store fewer or larger tensors per file, or large values as tensors"
        )
    return struct.pack("<Q", len(raw)) + raw


def layout(items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The order tensors are written in: widest element first, otherwise as given."""
    return sorted(items, key=lambda item: -item[1].element_size())


def deserialize(blob: bytes, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a file :func:`~ddpckpt._format.tensorwrite.serialize` produced, as private CPU tensors."""
    (length,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + length])
    start = 8 + length
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = dtype_from_name(info["dtype"], where)
        raw = bytearray(blob[start + begin : start + end])
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        tensors[key] = flat.view(dtype).reshape(info["shape"])
    return tensors


def can_read_into(target: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether :meth:`~ddpckpt._format.tensorread.TensorFile.read_into` can fill ``target`` with ``entry``."""
    return (
        entry.nbytes > 0
        and (target.device.type == "cpu" or target.is_cuda)
        and target.is_contiguous()
        and _DTYPES_BY_NAME.get(entry.dtype) == target.dtype
        and tuple(target.shape) == tuple(entry.shape)
    )
