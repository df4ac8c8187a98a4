"""A DTensor as a snapshot holds it (:class:`ShardedTensor`): this rank's local shard, the
global shape and where the shards lie (:class:`MeshLayout`). Captured and restored by
:mod:`ddpckpt._state.dtensor`; local to the calling rank."""

from __future__ import annotations

import functools
import math
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ddpckpt._format.reshard import Box
from ddpckpt._format.shards import REPLICATE, placement_dim


class RankOrder(tuple[int, ...]):
    """The global ranks of a device mesh, row-major, and what is derived from them, once:
    each rank's position and a digest. Captures of the tensors of one mesh share one
    (:mod:`ddpckpt._state.dtensor`), so at N ranks a save costs O(N) for the mesh, not
    O(N) per tensor."""

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """Each rank's index in the order."""
        return {rank: index for index, rank in enumerate(self)}

    @functools.cached_property
    def digest(self) -> str:
        """Equal for equal orders: what ranks compare instead of the N ranks themselves."""
        return xxhash.xxh3_64(array("q", self).tobytes()).hexdigest()

    @functools.cached_property
    def covers_the_job(self) -> bool:
        """Whether it lists every rank of a job of ``len(self)`` ranks, once each."""
        return sorted(self) == list(range(len(self)))


@dataclass(frozen=True)
class MeshLayout:
    """Where a DTensor's shards lie: its mesh (shape and the global rank at each
    coordinate, row-major) and placements (``"R"``, ``"S<dim>"``, one per mesh dim)."""

    shape: tuple[int, ...]
    ranks: RankOrder
    placements: tuple[str, ...]

    def __init__(
        self, shape: tuple[int, ...], ranks: Iterable[int], placements: tuple[str, ...]
    ) -> None:
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(
            self, "ranks", ranks if isinstance(ranks, RankOrder) else RankOrder(ranks)
        )
        object.__setattr__(self, "placements", tuple(placements))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate in the mesh (every rank of the job is in it)."""
        return self.coordinate_at(self.ranks.position[rank])

    def shard_key(self, coordinate: tuple[int, ...]) -> tuple[int, ...]:
        """The parts of ``coordinate`` along the ``Shard`` mesh dims: ranks with the same
        key hold the same region of every tensor of this layout (they are its replicas)."""
        return tuple(c for c, p in zip(coordinate, self.placements, strict=True) if p != REPLICATE)

    def replica_index(self, coordinate: tuple[int, ...]) -> int:
        """Which replica ``coordinate`` holds of its shard: its row-major index along the
        ``Replicate`` mesh dims (0 to :attr:`replicas` - 1)."""
        index = 0
        for c, size, p in zip(coordinate, self.shape, self.placements, strict=True):
            if p == REPLICATE:
                index = index * size + c
        return index

    @property
    def replicas(self) -> int:
        """How many ranks hold each shard (the product of the ``Replicate`` mesh dims)."""
        return math.prod(
            s for s, p in zip(self.shape, self.placements, strict=True) if p == REPLICATE
        )

    def coordinate_at(self, index: int) -> tuple[int, ...]:
        """The coordinate of the ``index``-th rank of the mesh, in row-major order."""
        coordinate = []
        for size in reversed(self.shape):
            index, at = divmod(index, size)
            coordinate.append(at)
        return tuple(reversed(coordinate))

    def region(self, shape: tuple[int, ...], rank: int) -> Box:
        """The part of a tensor of global ``shape`` that ``rank`` holds."""
        return region_at(shape, self.shape, self.placements, self.coordinate(rank))


def nonempty_shards(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...]
) -> int:
    """How many distinct non-empty regions :func:`region_at` gives over every coordinate of
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


def region_at(
    shape: tuple[int, ...],
    mesh: tuple[int, ...],
    placements: tuple[str, ...],
    coordinate: tuple[int, ...],
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


@dataclass
class ShardedTensor:
    """A DTensor as captured: this rank's local shard and where the shards lie."""

    local: torch.Tensor
    shape: tuple[int, ...]  # the global shape
    layout: MeshLayout

    def holders(self) -> Iterator[tuple[Box, list[int]]]:
        """Each distinct non-empty shard and the ranks holding it (its replicas): one region
        computed per rank of the mesh, each from the rank's position (finding each rank's
        coordinate by search would cost every rank N² steps per tensor at N ranks)."""
        layout = self.layout
        found: dict[Box, list[int]] = {}
        for index, rank in enumerate(layout.ranks):
            region = region_at(
                self.shape, layout.shape, layout.placements, layout.coordinate_at(index)
            )
            if math.prod(region[1]):
                found.setdefault(region, []).append(rank)
        yield from found.items()

    def fingerprint(self) -> list[Any]:
        """What every rank must agree on for the shards to be planned the same way."""
        layout = self.layout
        return [str(self.local.dtype), list(self.shape), list(layout.shape),
                layout.ranks.digest, list(layout.placements)]  # fmt: skip
