"""A DTensor as a snapshot holds it (:class:`ShardedTensor`): this rank's local shard, the
global shape and where the shards lie (:class:`MeshLayout`). Captured and restored by
:mod:`ddpckpt._state.dtensor`; local to the calling rank."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ddpckpt._format import shardgrid
from ddpckpt._format.reshard import Box
from ddpckpt._format.shardgrid import region_at


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
        return shardgrid.order_digest(self)

    @functools.cached_property
    def runs(self) -> shardgrid.MeshRanks:
        """The order as the manifest records it."""
        return shardgrid.MeshRanks.of(self)

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
        """See :func:`ddpckpt._format.shardgrid.shard_key`."""
        return shardgrid.shard_key(self.placements, coordinate)

    def replica_index(self, coordinate: tuple[int, ...]) -> int:
        """See :func:`ddpckpt._format.shardgrid.replica_index`."""
        return shardgrid.replica_index(self.shape, self.placements, coordinate)

    @property
    def replicas(self) -> int:
        """How many ranks hold each shard (the product of the ``Replicate`` mesh dims)."""
        return shardgrid.replicas(self.shape, self.placements)

    def coordinate_at(self, index: int) -> tuple[int, ...]:
        """The coordinate of the ``index``-th rank of the mesh, in row-major order."""
        return shardgrid.coordinate_at(self.shape, index)

    def region(self, shape: tuple[int, ...], rank: int) -> Box:
        """The part of a tensor of global ``shape`` that ``rank`` holds."""
        return region_at(shape, self.shape, self.placements, self.coordinate(rank))


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
