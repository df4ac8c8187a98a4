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
        index = self.ranks.index(rank)
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
        """Each distinct non-empty shard and the ranks holding it (its replicas)."""
        found: dict[Box, list[int]] = {}
        for rank in self.layout.ranks:
            region = self.layout.region(self.shape, rank)
            if math.prod(region[1]):
                found.setdefault(region, []).append(rank)
        yield from found.items()

    def fingerprint(self) -> list[Any]:
        """What every rank must agree on for the shards to be planned the same way."""
        layout = self.layout
        return [str(self.local.dtype), list(self.shape), list(layout.shape), list(layout.ranks),
                list(layout.placements)]  # fmt: skip
