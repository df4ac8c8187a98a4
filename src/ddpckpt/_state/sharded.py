"""A DTensor as a snapshot holds it (:class:`ShardedTensor`): this rank's local shard, the
global shape and where the shards lie (:class:`MeshLayout`). Captured and restored by
:mod:`ddpckpt._state.dtensor`; local to the calling rank."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ddpckpt._format.reshard import Box
from ddpckpt._format.shards import placement_dim


@dataclass(frozen=True)
class MeshLayout:
    """Where a DTensor's shards lie: its mesh (shape and the global rank at each
    coordinate, row-major) and placements (``"R"``, ``"S<dim>"``, one per mesh dim)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[str, ...]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate in the mesh (every rank of the job is in it)."""
        return self.coordinate_at(self.ranks.index(rank))

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
        return [str(self.local.dtype), list(self.shape), list(layout.shape), list(layout.ranks),
                list(layout.placements)]  # fmt: skip
