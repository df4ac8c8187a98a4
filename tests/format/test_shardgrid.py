"""The grid of a sharded tensor: the cells a region overlaps, found without visiting the
mesh, and a mesh's ranks kept as runs."""

from __future__ import annotations

import itertools
import math

import pytest

from ddpckpt._format.reshard import overlap
from ddpckpt._format.shardgrid import (
    MeshRanks,
    assign,
    cells_overlapping,
    coordinate_at,
    order_digest,
    position_of,
    region_at,
    replica_coordinate,
    replica_index,
    shard_key,
)

MESHES = [(1,), (4,), (3, 5), (2, 3, 2)]
SHAPES = [(0,), (1,), (7,), (12, 5), (3, 1, 9)]


def _regions(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The whole tensor, a single element, a band and an empty region of ``shape``."""
    whole = ((0,) * len(shape), shape)
    regions = [whole]
    if all(shape):
        regions.append((tuple(n - 1 for n in shape), (1,) * len(shape)))
        regions.append(((shape[0] // 3, *(0 for _ in shape[1:])),
                        (max(1, shape[0] // 2), *shape[1:])))  # fmt: skip
    regions.append(((0,) * len(shape), (0, *shape[1:])))
    return regions


@pytest.mark.parametrize("mesh", MESHES)
def test_the_cells_a_region_overlaps_are_those_visiting_every_coordinate_finds(mesh) -> None:
    for shape in SHAPES:
        for placements in itertools.product(
            ["R", *(f"S{d}" for d in range(len(shape)))], repeat=len(mesh)
        ):
            for region in _regions(shape):
                visited = set()
                for coordinate in itertools.product(*(range(m) for m in mesh)):
                    cell = region_at(shape, mesh, placements, coordinate)
                    if math.prod(cell[1]) and overlap(cell, region) is not None:
                        visited.add(cell)
                found = cells_overlapping(shape, mesh, placements, region)
                cells = [region_at(shape, mesh, placements, c) for c in found]
                assert len(cells) == len(set(cells)) and set(cells) == visited, (
                    shape, placements, region,
                )  # fmt: skip
                assert all(c[d] == 0 for c in found for d, p in enumerate(placements) if p == "R")


def test_a_region_of_one_shard_among_16384_is_found_without_visiting_the_mesh() -> None:
    mesh, placements, shape = (2048, 8), ("S0", "S1"), (1 << 20, 4096)
    region = region_at(shape, mesh, placements, (1234, 5))
    assert cells_overlapping(shape, mesh, placements, region) == [(1234, 5)]


def test_coordinates_positions_keys_and_replicas_invert_each_other() -> None:
    mesh, placements = (3, 2, 4), ("R", "S0", "R")
    for position in range(math.prod(mesh)):
        coordinate = coordinate_at(mesh, position)
        assert position_of(mesh, coordinate) == position
        key, replica = (
            shard_key(placements, coordinate),
            replica_index(mesh, placements, coordinate),
        )
        assert replica_coordinate(mesh, placements, key, replica) == coordinate


@pytest.mark.parametrize(
    "ranks",
    [list(range(16384)), list(reversed(range(8))), [4, 5, 6, 7, 0, 1, 2, 3], [2, 0, 3, 1], [9]],
)
def test_a_mesh_s_ranks_as_runs(ranks) -> None:
    mesh = MeshRanks.of(ranks)
    assert list(mesh) == ranks and len(mesh) == len(ranks)
    assert [mesh.rank_at(p) for p in range(len(ranks))] == ranks
    assert [mesh.position(r) for r in ranks] == list(range(len(ranks)))
    assert mesh.position(max(ranks) + 1) is None and mesh.position(-1) is None
    assert mesh.digest == order_digest(ranks)
    if ranks == sorted(ranks):
        assert len(mesh.runs) == 1  # what init_device_mesh builds, at any size


def test_the_writers_of_a_shard_share_its_tensors_largest_first() -> None:
    cells = [(10, "a"), (30, "b"), (20, "c"), (30, "d"), (5, "e")]
    assert assign(cells, 2) == {"b": 0, "d": 1, "c": 0, "a": 1, "e": 1}
    assert assign(cells, 9) == {"b": 0, "d": 1, "c": 2, "a": 3, "e": 4}
    assert assign([], 3) == {}
