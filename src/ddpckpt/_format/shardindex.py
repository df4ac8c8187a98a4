"""Index files of sharded tensors (format 6): each writing rank lists the shards it wrote,
and a reader reads only the indexes of the shards it needs.

A rank that writes shards of sharded tensors (:mod:`ddpckpt._io.shardwrite`) also writes
``shards-NNNNN.json`` (its rank), listed in the manifest's files like its data files::

    {"format": "ddpckpt-shards", "id": "<the checkpoint's id>", "rank": 3,
     "pieces": {"<tensor name>": {<a piece, as in ddpckpt._format.shards>}, ...}}

The manifest keeps each sharded tensor's dtype, shape, mesh and placements, and each
mesh's ranks as runs (:class:`~ddpckpt._format.shardgrid.MeshRanks`), so it does not grow
with the number of shards. :class:`ShardIndex` finds, from those alone, the cells a region
overlaps and the rank that wrote each (:mod:`ddpckpt._format.shardgrid`), and reads those
ranks' indexes, each verified against the manifest's digest and each piece checked to be
exactly the cell it should be: a rank that loads its own FSDP2 shards under the layout they
were saved with reads one index, whatever the number of ranks (under HSDP, one per replica
that wrote some of its shards' tensors: at most one per tensor).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpckpt._format.boundary import MAX_MANIFEST_BYTES, load_json, read_listed
from ddpckpt._format.filetable import FileTable
from ddpckpt._format.reshard import Box
from ddpckpt._format.shardgrid import (
    Coordinate,
    MeshRanks,
    Pattern,
    assign,
    cells_overlapping,
    coordinate_at,
    holders_by_key,
    pattern,
    position_of,
    region_at,
    replica_coordinate,
    replicas,
    shard_key,
)
from ddpckpt._format.shards import Piece, ShardedEntry, parse_piece
from ddpckpt._format.tensorfile import dtype_from_name
from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError
from ddpckpt.storage._location import Location

INDEX_FORMAT = "ddpckpt-shards"


def index_name(rank: int) -> str:
    """The name of ``rank``'s index file in a checkpoint."""
    return f"shards-{rank:05d}.json"


def index_document(token: str, rank: int, pieces: dict[str, dict[str, Any]]) -> bytes:
    """The index file of ``rank``'s ``pieces`` (tensor name -> piece JSON) in the
    checkpoint ``token``."""
    doc = {"format": INDEX_FORMAT, "id": token, "rank": rank, "pieces": pieces}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _pattern(record: ShardedEntry) -> Pattern:
    """What decides which ranks are a cell's replicas (as the save's planner groups)."""
    return pattern(record.ranks, record.mesh, record.placements)


@dataclass(frozen=True)
class _Holders:
    """The ``count`` replicas that may write the cells of one shard key, slot -> rank."""

    count: int
    rank: Callable[[int], int]

    def __call__(self, slot: int) -> int:
        return self.rank(slot)


class ShardIndex:
    """The pieces of a format-6 checkpoint's sharded tensors, from the writers' index files.

    ``records`` are the manifest's sharded tensors, ``meshes`` its rank orders,
    ``files`` its files, ``domain`` the ranks that wrote this copy when each node wrote
    its own (else ``None``), ``writers`` the most replicas of a shard that wrote its
    tensors (format 7; ``None``: all of them). Local to the calling process.
    """

    def __init__(
        self,
        location: Location,
        token: str,
        records: dict[str, ShardedEntry],
        meshes: dict[str, MeshRanks],
        files: FileTable,
        domain: list[int] | None,
        writers: int | None = None,
    ) -> None:
        self.location, self.path = location, location.path
        self.token, self.records, self.meshes = token, records, meshes
        self.files, self.domain, self.writers = files, domain, writers
        self._indexes: dict[int, dict[str, Piece]] = {}
        self._members: dict[Pattern, list[str]] | None = None
        self._writers: dict[tuple[Pattern, Coordinate], dict[str, int]] = {}
        self._grouped: dict[Pattern, dict[Coordinate, list[int]]] = {}

    def pieces(self, name: str, region: Box) -> list[Piece]:
        """The pieces of ``name`` that overlap ``region``, each checked to be its cell."""
        record = self.records[name]
        found = []
        for coordinate in cells_overlapping(record.shape, record.mesh, record.placements, region):
            writer = self.writer(name, coordinate)
            piece = self.index(writer).get(name)
            cell = region_at(record.shape, record.mesh, record.placements, coordinate)
            if piece is None or (piece.offsets, piece.shape) != cell:
                raise self._bad(
                    f"{index_name(writer)}, rank {writer}'s shard index, does not list the "
                    f"shard of {name[:200]!r} at {list(cell[0])} of shape {list(cell[1])}, "
                    "which that rank wrote"
                )
            found.append(piece)
        return found

    def writer(self, name: str, coordinate: Coordinate) -> int:
        """The rank that wrote ``name``'s cell at ``coordinate`` (see
        :mod:`ddpckpt._format.shardgrid`): the save's own rule, recomputed once per shard
        key over the tensors of its mesh."""
        record = self.records[name]
        group, key = _pattern(record), shard_key(record.placements, coordinate)
        writers = self._writers.get((group, key))
        if writers is None:
            cells = []
            for member in self._pattern_members()[group]:
                other = self.records[member]
                size = region_at(other.shape, other.mesh, other.placements, coordinate)[1]
                if math.prod(size):
                    itemsize = dtype_from_name(other.dtype, self.path).itemsize
                    cells.append((math.prod(size) * itemsize, member))
            holders = self._holders_of(record, group, key)
            slots = assign(cells, holders.count, self.writers)
            writers = self._writers[(group, key)] = {n: holders(s) for n, s in slots.items()}
        if name not in writers:
            raise self._bad(f"{name[:200]!r} has no shard at mesh coordinate {list(coordinate)}")
        return writers[name]

    def _holders_of(self, record: ShardedEntry, group: Pattern, key: Coordinate) -> _Holders:
        """The ranks that may have written the cells at ``key``, in replica order: every
        replica when all ranks shared the storage, else those of this copy's domain."""
        mesh = self.meshes[record.ranks]
        if self.domain is None:
            return _Holders(
                replicas(record.mesh, record.placements),
                lambda slot: mesh.rank_at(
                    position_of(
                        record.mesh, replica_coordinate(record.mesh, record.placements, key, slot)
                    )
                ),
            )
        grouped = self._grouped.get(group)
        if grouped is None:
            positions = ((m, mesh.position(m)) for m in self.domain)
            members = [(m, coordinate_at(record.mesh, p)) for m, p in positions if p is not None]
            grouped = self._grouped[group] = holders_by_key(record.mesh, record.placements, members)
        holders = grouped.get(key)
        if not holders:
            raise self._bad(
                f"none of the ranks that wrote this node's copy held the shards at mesh "
                f"coordinate {list(key)}: the copy is incomplete"
            )
        return _Holders(len(holders), holders.__getitem__)

    def _pattern_members(self) -> dict[Pattern, list[str]]:
        if self._members is None:
            self._members = {}
            for name, record in self.records.items():
                self._members.setdefault(_pattern(record), []).append(name)
        return self._members

    def index(self, rank: int) -> dict[str, Piece]:
        """``rank``'s index: every piece it wrote, read once and checked."""
        found = self._indexes.get(rank)
        if found is None:
            found = self._indexes[rank] = self._read(rank)
        return found

    def file_of(self, rank: int) -> str | None:
        """The name (as the manifest lists it) of ``rank``'s index file, if it wrote one:
        looked up, not searched for, so that only the file table of ``rank``'s group is
        read (format 7)."""
        return self.files.find(index_name(rank))

    def _read(self, rank: int) -> dict[str, Piece]:
        name = self.file_of(rank)
        if name is None:
            raise IncompleteCheckpointError(
                f"{self.path}: the manifest lists no {index_name(rank)}, the shard index of "
                f"rank {rank}, which wrote shards"
            )
        listed = self.files[name]
        at = self.location.join(name)
        location = at.path
        try:
            raw = read_listed(
                at, listed.size, listed.digest, "shard index", limit=MAX_MANIFEST_BYTES
            )
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{self.path}: {name}, which the checkpoint lists, is missing"
            ) from None
        doc = load_json(raw, location, "shard index")
        if (
            not isinstance(doc, dict)
            or doc.get("format") != INDEX_FORMAT
            or doc.get("id") != self.token
            or doc.get("rank") != rank
            or not isinstance(doc.get("pieces"), dict)
        ):
            raise CorruptCheckpointError(
                f"{location}: not the shard index of rank {rank} of this checkpoint"
            )
        prefix = name[: len(name) - len(index_name(rank))]  # an object store's replacement

        def bad(what: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{location}: malformed shard index: {what}")

        pieces = {}
        for tensor, piece_doc in doc["pieces"].items():
            record = self.records.get(tensor)
            if record is None or not record.indexed:
                raise bad(f"lists {tensor[:200]!r}, which is no sharded tensor of the manifest")
            piece = parse_piece(record, piece_doc, bad)
            file = self.files.get(prefix + piece.entry.file)
            if file is None or file.writer != rank or piece.entry.end > file.size:
                raise bad(
                    f"a shard of {tensor[:200]!r} lies outside the files rank {rank} wrote "
                    f"({piece.entry.file[:200]!r})"
                )
            entry = dataclasses.replace(piece.entry, file=prefix + piece.entry.file)
            pieces[tensor] = Piece(piece.offsets, entry)
        return pieces

    def _bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {what}")


def is_index_file(name: str) -> bool:
    """Whether ``name`` (as a manifest lists it) is a shard index, not a safetensors file."""
    base = name.rpartition("/")[2]
    return base.startswith("shards-") and base.endswith(".json")
