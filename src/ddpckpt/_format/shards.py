"""Sharded tensors in a manifest: a global tensor stored as the distinct shards ranks held.

A tensor that no rank holds whole (a DTensor of FSDP2, HSDP or ``replicate()``; see
:mod:`ddpckpt._state.dtensor`) is recorded under the manifest's ``shards`` as a
:class:`ShardedEntry`: its dtype, global shape, the mesh and placements it was saved with,
and one :class:`Piece` per distinct shard: where the shard lies in the global tensor
(``offsets`` and ``shape``) and where its bytes are (a safetensors entry of a data file,
written by one owner among the ranks that held that shard). Every piece carries, besides
the digest of its bytes, a digest of each ``chunk`` bytes of them, so a loading rank that
needs only a slice reads the chunks around it (ranged reads) and still verifies every
byte it uses (:mod:`ddpckpt._format.reshard` plans those reads).

The pieces of a record tile the global tensor: they are the cells of a grid, each cell
exactly once, which is what any combination of ``Shard`` and ``Replicate`` placements
produces. A manifest whose pieces overlap, leave a gap or fall outside the tensor is
malformed: loading it could leave part of a tensor unwritten.

Since format 6 a record lists no pieces: it names its mesh's rank order instead
(``"ranks"``, a key of the manifest's ``meshes``), and each piece's record is in the index
file of the rank that wrote it (:mod:`ddpckpt._format.shardindex`), so the manifest does
not grow with the number of ranks. Format 5 (pieces in the manifest) still loads.

JSON (one record, format 5)::

    {"dtype": "F32", "shape": [7, 5], "mesh": [2, 2], "placements": ["R", "S0"],
     "chunk": 8388608,
     "pieces": [{"offsets": [0, 0], "shape": [4, 5], "file": "model-00000.safetensors",
                 "key": "0.weight@0,0", "range": [1024, 1104], "xxh3_64": "...",
                 "chunks": ["..."]}, ...]}
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpckpt._format.shardgrid import REPLICATE, nonempty_shards
from ddpckpt._format.tensorfile import MAX_EXTENT, TensorEntry, dtype_from_name, spanned_bytes
from ddpckpt.errors import CorruptCheckpointError

_MESH_KEY = re.compile(r"[0-9a-f]{16}", re.ASCII)  # a mesh's key in the manifest: its digest
_MAX_DIMS = 64
_MAX_MESH_DIMS = 8
_MAX_MESH_SIZE = 1 << 24
_MAX_CHUNK = 1 << 40
# Every dimension, offset, byte position and size in a record is below MAX_EXTENT, and so
# is any tensor's size in bytes with its empty dimensions counted as 1 (what torch's
# strides reach): nothing read from a manifest overflows torch's 64-bit sizes or strides.


def shard_placement(dim: int) -> str:
    """How the manifest writes ``Shard(dim)``."""
    return f"S{dim}"


@dataclass(frozen=True)
class Piece:
    """One distinct shard of a sharded tensor: its place in the global tensor and its bytes.

    ``entry`` is its safetensors entry (file, key, the piece's own shape, byte range,
    digest); ``chunks`` the digests of each ``chunk`` bytes of it, in order.
    """

    offsets: tuple[int, ...]
    entry: TensorEntry

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def to_json(self) -> dict[str, Any]:
        e = self.entry
        return {"offsets": list(self.offsets), "shape": list(e.shape), "file": e.file,
                "key": e.key, "range": [e.begin, e.end], "xxh3_64": e.digest,
                "chunks": list(e.chunks)}  # fmt: skip


@dataclass(frozen=True)
class ShardedEntry:
    """A tensor stored as shards (see the module docstring): ``pieces`` in format 5,
    ``ranks`` (its mesh's key in the manifest's ``meshes``) and no pieces since format 6."""

    dtype: str
    shape: tuple[int, ...]
    mesh: tuple[int, ...]  # the device mesh's shape when saved
    placements: tuple[str, ...]  # one per mesh dimension: "R" or "S<dim>"
    chunk: int  # bytes per chunk digest
    pieces: tuple[Piece, ...] = ()
    ranks: str = ""

    @property
    def indexed(self) -> bool:
        """Whether its pieces are in the writers' index files (format 6; a record read
        names its mesh exactly then)."""
        return bool(self.ranks) and not self.pieces

    @property
    def shard_count(self) -> int:
        """How many distinct non-empty shards it is stored as."""
        return nonempty_shards(self.shape, self.mesh, self.placements)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype, "").itemsize

    def describe(self) -> str:
        """The placement for people: ``mesh (2, 2), placements (R, S0), 2 shards``."""
        count = self.shard_count
        return (
            f"mesh {tuple(self.mesh)}, placements ({', '.join(self.placements)}), "
            f"{count} shard{'s' if count != 1 else ''}"
        )

    def to_json(self) -> dict[str, Any]:
        doc = {"dtype": self.dtype, "shape": list(self.shape), "mesh": list(self.mesh),
               "placements": list(self.placements), "chunk": self.chunk}  # fmt: skip
        if self.indexed:
            return {**doc, "ranks": self.ranks}
        return {**doc, "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> ShardedEntry:
        """Parse and check one record; raises :class:`CorruptCheckpointError` naming ``where``."""

        def bad(what: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: malformed manifest: {what}")

        if not isinstance(doc, dict):
            raise bad("a sharded tensor is not a JSON object")
        dtype = _field(doc, "dtype", str, bad)
        itemsize = dtype_from_name(dtype, where).itemsize
        shape = _ints(_field(doc, "shape", list, bad), "shape", bad, limit=_MAX_DIMS)
        _extent(shape, itemsize, "shape", bad)
        mesh = _ints(_field(doc, "mesh", list, bad), "mesh", bad, limit=_MAX_MESH_DIMS, low=1)
        if not mesh or math.prod(mesh) > _MAX_MESH_SIZE:
            raise bad(f"mesh {mesh} is empty or larger than {_MAX_MESH_SIZE} ranks")
        placements = _field(doc, "placements", list, bad)
        if len(placements) != len(mesh) or not all(
            _valid_placement(p, len(shape)) for p in placements
        ):
            raise bad(f"placements {placements!r} do not fit mesh {mesh} and shape {shape}")
        chunk = _field(doc, "chunk", int, bad)
        if not 0 < chunk <= _MAX_CHUNK:
            raise bad(f"chunk size {chunk} out of range")
        if "pieces" not in doc:  # format 6: the pieces are in the writers' index files
            ranks = _field(doc, "ranks", str, bad)
            if not _MESH_KEY.fullmatch(ranks):
                raise bad(f"its mesh {ranks[:40]!r} is not the key of a mesh")
            return cls(dtype, tuple(shape), tuple(mesh), tuple(placements), chunk, (), ranks)
        pieces_doc = _field(doc, "pieces", list, bad)
        if len(pieces_doc) > math.prod(mesh):
            raise bad(f"{len(pieces_doc)} shards on a mesh of {math.prod(mesh)} ranks")
        pieces = tuple(_piece(p, dtype, shape, itemsize, chunk, bad) for p in pieces_doc)
        _check_tiling(shape, pieces, bad)
        return cls(dtype, tuple(shape), tuple(mesh), tuple(placements), chunk, pieces)


def chunk_count(nbytes: int, chunk: int) -> int:
    """How many chunk digests a piece of ``nbytes`` has."""
    return -(-nbytes // chunk)


def _field(doc: dict[str, Any], key: str, kind: type, bad: Any) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise bad(f"sharded tensor field {key!r} missing or not a {kind.__name__}")
    return value


def _ints(values: list[Any], what: str, bad: Any, *, limit: int, low: int = 0) -> list[int]:
    if len(values) > limit or not all(type(v) is int and low <= v < MAX_EXTENT for v in values):
        raise bad(
            f"{what} {_shown(values)} is not a list of at most {limit} integers in [{low}, 2**62)"
        )
    return values


def _shown(values: list[Any]) -> str:
    """``values`` for a message: short, whatever they hold (an int of thousands of digits
    cannot even be printed)."""
    items = [
        repr(v)[:40] if not isinstance(v, int) or v.bit_length() <= 64 else "<a huge integer>"
        for v in values[:8]
    ]
    return f"[{', '.join(items)}{', ...' if len(values) > 8 else ''}]"


def _extent(shape: list[int], itemsize: int, what: str, bad: Any) -> int:
    """:func:`~ddpckpt._format.tensorfile.spanned_bytes`, or ``bad``'s error from 2**62 bytes on."""
    total = spanned_bytes(shape, itemsize)
    if total is None:
        raise bad(f"{what} {_shown(shape)} of {itemsize}-byte elements spans 2**62 bytes or more")
    return total


def _valid_placement(placement: Any, ndim: int) -> bool:
    if placement == REPLICATE:
        return True
    if not isinstance(placement, str) or not placement.startswith("S"):
        return False
    digits = placement[1:]
    return digits.isdigit() and digits == str(int(digits)) and int(digits) < ndim


def parse_piece(record: ShardedEntry, doc: Any, bad: Callable[[str], Exception]) -> Piece:
    """One piece of ``record`` from JSON (an index file's), checked as the manifest's are."""
    itemsize = dtype_from_name(record.dtype, "").itemsize
    return _piece(doc, record.dtype, list(record.shape), itemsize, record.chunk, bad)


def _piece(doc: Any, dtype: str, shape: list[int], itemsize: int, chunk: int, bad: Any) -> Piece:
    if not isinstance(doc, dict):
        raise bad("a shard is not a JSON object")
    offsets = _ints(_field(doc, "offsets", list, bad), "offsets", bad, limit=_MAX_DIMS)
    size = _ints(_field(doc, "shape", list, bad), "shard shape", bad, limit=_MAX_DIMS, low=1)
    if len(offsets) != len(shape) or len(size) != len(shape):
        raise bad(f"shard at {offsets} of shape {size} has not the tensor's {len(shape)} dims")
    if any(o + s > g for o, s, g in zip(offsets, size, shape, strict=True)):
        raise bad(f"shard at {offsets} of shape {size} lies outside the shape {shape}")
    span = _ints(_field(doc, "range", list, bad), "range", bad, limit=2)
    nbytes = _extent(size, itemsize, "shard shape", bad)  # no empty dim (low=1): its bytes
    if len(span) != 2 or span[1] - span[0] != nbytes:
        raise bad(f"shard at {offsets}: byte range {span} does not hold {nbytes} bytes")
    chunks = _field(doc, "chunks", list, bad)
    if len(chunks) != chunk_count(nbytes, chunk) or not all(isinstance(c, str) for c in chunks):
        raise bad(f"shard at {offsets}: {len(chunks)} chunk digests for {nbytes} bytes")
    entry = TensorEntry(
        file=_field(doc, "file", str, bad),
        key=_field(doc, "key", str, bad),
        dtype=dtype,
        shape=tuple(size),
        begin=span[0],
        end=span[1],
        digest=_field(doc, "xxh3_64", str, bad),
        chunks=tuple(chunks),
    )
    return Piece(tuple(offsets), entry)


def _check_tiling(shape: list[int], pieces: tuple[Piece, ...], bad: Any) -> None:
    """Raise unless ``pieces`` are the cells of a grid over ``shape``, each exactly once."""
    if math.prod(shape) == 0:
        if pieces:
            raise bad(f"an empty tensor of shape {shape} has shards")
        return
    for dim, extent in enumerate(shape):
        spans = sorted({(p.offsets[dim], p.shape[dim]) for p in pieces})
        end = 0
        for start, length in spans:
            if start != end:
                raise bad(f"shards overlap or leave a gap along dimension {dim} at {end}")
            end = start + length
        if end != extent:
            raise bad(f"shards cover {end} of {extent} along dimension {dim}")
    if len({p.offsets for p in pieces}) != len(pieces) or len(pieces) != math.prod(
        len({(p.offsets[d], p.shape[d]) for p in pieces}) for d in range(len(shape))
    ):
        raise bad("shards do not tile the tensor: some are missing or listed twice")
