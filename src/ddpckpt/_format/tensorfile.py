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
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    except KeyError:
        raise CorruptCheckpointError(f"{where}: unknown tensor dtype {name!r}") from None


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
