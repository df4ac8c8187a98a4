"""The grid of a sharded tensor and who writes each cell: pure functions both the save's
planner (:mod:`ddpckpt._io.shardwrite`) and the reader (:mod:`ddpckpt._format.shardindex`)
compute, so that a reader finds a shard's record without any list of every shard.

A DTensor's placements cut its global shape into a grid: :func:`region_at` gives the cell
held at a coordinate of the device mesh. Ranks that differ only along ``Replicate`` mesh
dims hold the same cell (its *replicas*); of those, one writes it. Which one is decided per
*shard key* (the coordinate along the ``Shard`` dims) over every tensor of a mesh at once,
by :func:`assign`: largest first, each to the least-loaded replica. Since format 6 each
writer lists the cells it wrote in its own index file, and the manifest keeps only each
tensor's shape, mesh and placements plus the mesh's ranks as runs (:class:`MeshRanks`):
a loading rank computes the cells its region overlaps (:func:`cells_overlapping`), their
writers, and reads only those writers' indexes. Nothing here grows with the number of
ranks except where a caller asks for every cell.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from ddpckpt._format.reshard import Box

REPLICATE = "R"
Coordinate = tuple[int, ...]


def placement_dim(placement: str) -> int | None:
    """The tensor dimension ``placement`` splits, or ``None`` for ``Replicate``."""
    return None if placement == REPLICATE else int(placement[1:])


def region_at(
    shape: Sequence[int], mesh: Sequence[int], placements: Sequence[str], coordinate: Coordinate
) -> Box:
    """The ``(offsets, shape)`` held at ``coordinate`` of ``mesh``: each ``Shard(d)``,
    in mesh-dimension order, splits what is left of dimension ``d`` as ``torch.chunk``
    does (chunks of the rounded-up size; the last ones short or empty)."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        dim = placement_dim(placement)
        if dim is None:
            continue
        full = -(-sizes[dim] // mesh[mesh_dim])
        start = min(coordinate[mesh_dim] * full, sizes[dim])
        offsets[dim] += start
        sizes[dim] = min(start + full, sizes[dim]) - start
    return tuple(offsets), tuple(sizes)


def nonempty_shards(shape: Sequence[int], mesh: Sequence[int], placements: Sequence[str]) -> int:
    """How many distinct non-empty cells :func:`region_at` gives over every coordinate of
    ``mesh``, counted without visiting them: per tensor dimension, the extents its chunks
    take (at most two distinct ones per split) and how many chunks take each."""
    extents = [Counter({n: 1}) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        dim = placement_dim(placement)
        if dim is None:
            continue
        split: Counter[int] = Counter()
        for extent, count in extents[dim].items():
            full = -(-extent // mesh[mesh_dim])
            if full:
                whole, rest = divmod(extent, full)
                split[full] += whole * count
                if rest:
                    split[rest] += count
        extents[dim] = split
    return math.prod(sum(n for extent, n in counts.items() if extent) for counts in extents)


def cells_overlapping(
    shape: Sequence[int], mesh: Sequence[int], placements: Sequence[str], region: Box
) -> list[Coordinate]:
    """The mesh coordinates (``0`` along ``Replicate`` dims) of the non-empty cells that
    overlap ``region``, each once: found by walking the splits, so the cost is the number
    of cells returned times the mesh's dims, never the size of the mesh."""
    low, extent = region
    if any(n <= 0 for n in extent):
        return []
    found: list[Coordinate] = []

    def walk(mesh_dim: int, coordinate: list[int], offsets: list[int], sizes: list[int]) -> None:
        if mesh_dim == len(placements):
            if all(sizes):
                found.append(tuple(coordinate))
            return
        dim = placement_dim(placements[mesh_dim])
        if dim is None:
            walk(mesh_dim + 1, [*coordinate, 0], offsets, sizes)
            return
        full = -(-sizes[dim] // mesh[mesh_dim])
        start = max(low[dim], offsets[dim])
        end = min(low[dim] + extent[dim], offsets[dim] + sizes[dim])
        if not full or end <= start:
            return
        first = (start - offsets[dim]) // full
        last = min((end - 1 - offsets[dim]) // full, mesh[mesh_dim] - 1)
        for c in range(first, last + 1):
            begin = c * full
            inner_offsets, inner_sizes = list(offsets), list(sizes)
            inner_offsets[dim] = offsets[dim] + begin
            inner_sizes[dim] = min(full, sizes[dim] - begin)
            walk(mesh_dim + 1, [*coordinate, c], inner_offsets, inner_sizes)

    walk(0, [], [0] * len(shape), list(shape))
    return found


def coordinate_at(mesh: Sequence[int], position: int) -> Coordinate:
    """The coordinate of the ``position``-th rank of ``mesh``, in row-major order."""
    coordinate = []
    for size in reversed(mesh):
        position, at = divmod(position, size)
        coordinate.append(at)
    return tuple(reversed(coordinate))


def position_of(mesh: Sequence[int], coordinate: Coordinate) -> int:
    """The row-major position of ``coordinate`` in ``mesh``."""
    position = 0
    for size, at in zip(mesh, coordinate, strict=True):
        position = position * size + at
    return position


def shard_key(placements: Sequence[str], coordinate: Coordinate) -> Coordinate:
    """The parts of ``coordinate`` along the ``Shard`` mesh dims: coordinates with the same
    key hold the same cell of every tensor of their mesh (they are its replicas)."""
    return tuple(c for c, p in zip(coordinate, placements, strict=True) if p != REPLICATE)


def replica_index(mesh: Sequence[int], placements: Sequence[str], coordinate: Coordinate) -> int:
    """Which replica ``coordinate`` holds of its cell: its row-major index along the
    ``Replicate`` mesh dims."""
    index = 0
    for c, size, p in zip(coordinate, mesh, placements, strict=True):
        if p == REPLICATE:
            index = index * size + c
    return index


def replicas(mesh: Sequence[int], placements: Sequence[str]) -> int:
    """How many coordinates hold each cell (the product of the ``Replicate`` mesh dims)."""
    return math.prod(s for s, p in zip(mesh, placements, strict=True) if p == REPLICATE)


def replica_coordinate(
    mesh: Sequence[int], placements: Sequence[str], key: Coordinate, replica: int
) -> Coordinate:
    """The coordinate of replica ``replica`` of the cell whose shard key is ``key``: the
    inverse of :func:`shard_key` and :func:`replica_index`."""
    along = coordinate_at([s for s, p in zip(mesh, placements, strict=True) if p == REPLICATE],
                          replica)  # fmt: skip
    keys, reps = iter(key), iter(along)
    return tuple(next(reps) if p == REPLICATE else next(keys) for p in placements)


Pattern = tuple[str, tuple[int, ...], tuple[bool, ...]]  # mesh ranks, mesh shape, replicated


def pattern(ranks: str, mesh: Sequence[int], placements: Sequence[str]) -> Pattern:
    """What decides which ranks are a cell's replicas, for tensors of one group: the mesh's
    rank order (its digest), its shape, and which of its dims replicate."""
    return ranks, tuple(mesh), tuple(p == REPLICATE for p in placements)


def holders_by_key(
    mesh: Sequence[int], placements: Sequence[str], members: Iterable[tuple[int, Coordinate]]
) -> dict[Coordinate, list[int]]:
    """Of ``members`` (a rank and its coordinate in the mesh: one storage domain's), those
    holding the cells of each shard key, in replica order: the ranks that may write them."""
    found: dict[Coordinate, list[tuple[int, int]]] = {}
    for rank, at in members:
        found.setdefault(shard_key(placements, at), []).append(
            (replica_index(mesh, placements, at), rank)
        )
    return {key: [rank for _, rank in sorted(held)] for key, held in found.items()}


# At most this many replicas of a shard write its tensors (format 7: the manifest's
# "shard_writers"): enough to spread a save's writes over 64 nodes, and a rank loading its
# shards under HSDP reads at most 64 writers' indexes, whatever the number of replicas.
SHARD_WRITERS = 64


def assign(
    cells: Iterable[tuple[int, str]], count: int, writers: int | None = None
) -> dict[str, int]:
    """Which of ``count`` replicas writes each tensor's cell at one shard key: ``cells``
    are (bytes, tensor name); largest first, each to the least-loaded replica, ties to the
    lowest, among the first ``writers`` replicas (all without it: checkpoints before format
    7). The rule of the format: a reader recomputes it to find a cell's writer."""
    ordered = sorted(cells, key=lambda c: (-c[0], c[1]))
    if writers is not None:
        count = min(count, writers)
    heap = [(0, s) for s in range(min(count, len(ordered)))]  # the others would get nothing
    slots = {}
    for nbytes, name in ordered:
        load, slot = heapq.heappop(heap)
        slots[name] = slot
        heapq.heappush(heap, (load + max(nbytes, 1), slot))
    return slots


Runs = tuple[tuple[int, int], ...]  # (first rank, how many consecutive ranks)


@dataclass(frozen=True)
class MeshRanks:
    """The global ranks of a device mesh in row-major order, kept as runs of consecutive
    ranks: one run for every mesh built with ``init_device_mesh`` (whatever its size), so
    the manifest's record of a mesh does not grow with the number of ranks."""

    runs: Runs

    @classmethod
    def of(cls, ranks: Sequence[int]) -> MeshRanks:
        runs: list[tuple[int, int]] = []
        for rank in ranks:
            if runs and runs[-1][0] + runs[-1][1] == rank:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((rank, 1))
        return cls(tuple(runs))

    @functools.cached_property
    def _starts(self) -> list[int]:
        starts, at = [], 0
        for _, count in self.runs:
            starts.append(at)
            at += count
        return starts

    def __len__(self) -> int:
        return self._length

    @functools.cached_property
    def _length(self) -> int:
        return sum(count for _, count in self.runs)

    def __iter__(self) -> Iterator[int]:
        for first, count in self.runs:
            yield from range(first, first + count)

    def rank_at(self, position: int) -> int:
        """The global rank at ``position`` (row-major) of the mesh."""
        run = bisect.bisect_right(self._starts, position) - 1
        return self.runs[run][0] + position - self._starts[run]

    @functools.cached_property
    def _by_first(self) -> list[tuple[int, int]]:
        return sorted((first, i) for i, (first, _) in enumerate(self.runs))

    def position(self, rank: int) -> int | None:
        """Where ``rank`` lies in the mesh, or ``None`` if it is not in it."""
        at = bisect.bisect_right(self._by_first, (rank, len(self.runs))) - 1
        if at < 0:
            return None
        first, run = self._by_first[at]
        if rank - first >= self.runs[run][1]:
            return None
        return self._starts[run] + rank - first

    @functools.cached_property
    def digest(self) -> str:
        """Equal for equal rank orders (what the save's planner groups meshes by)."""
        return order_digest(list(self))


def order_digest(ranks: Sequence[int]) -> str:
    """The digest of a mesh's rank order, as :class:`MeshRanks` and the live mesh give it."""
    return xxhash.xxh3_64(array("q", ranks).tobytes()).hexdigest()
